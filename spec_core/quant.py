"""Weight-only int8 (``--dtype int8``): each weight matrix is stored as int8 with one symmetric scale per output
channel, and multiplied through torch's int8 weight-only kernel (``_weight_int8pack_mm``) with bf16 inputs.

Everything else (embedding rows, norms, RoPE, attention, the KV cache, logits) stays in the runner's compute dtype,
fp32. A token reads a quarter of fp32's weight bytes. It is a different numeric model from fp32, so its greedy
agreement with fp32 is reported, never assumed; the fp32 runner stays the exactness reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The kernel's input dtype: its CPU path is vectorised for bf16 inputs (fp32 inputs take a ~10x slower path).
KERNEL_INPUT_DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A ``[in, out]`` weight as int8 ``q [out, in]`` and per-output-channel ``scale [out]``: w ≈ q * scale."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """The float matrix's shape, ``[in, out]`` (as the runner stores its float weights)."""
        return self.q.shape[1], self.q.shape[0]

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


def quantize_int8(w_t: torch.Tensor) -> Int8Weight:
    """Quantize a ``[in, out]`` float weight: scale ≈ max |w| of its output channel / 127, round to nearest."""
    if w_t.device.type != "cpu":
        raise ValueError("dtype int8 (weight-only int8) runs on CPU only; on GPUs use bfloat16")
    w = w_t.t().float()
    # The kernel reads the scale in bf16: round it up (bf16's relative step is 2^-8) so that no |w| / scale
    # exceeds 127, and quantize against the rounded scale itself, so the error stays within half a step.
    scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0 * (1 + 2**-7)).to(KERNEL_INPUT_DTYPE)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(q, scale)


def dequantize(w: Int8Weight) -> torch.Tensor:
    """The ``[in, out]`` fp32 matrix an :class:`Int8Weight` stands for (for tests and error reports)."""
    return (w.q.float() * w.scale.float()[:, None]).t()


def matmul(x: torch.Tensor, w: torch.Tensor | Int8Weight) -> torch.Tensor:
    """``x @ w`` for a float ``[in, out]`` matrix or an :class:`Int8Weight`; the result has ``x``'s dtype."""
    if isinstance(w, torch.Tensor):
        return x @ w
    flat = x.reshape(-1, x.shape[-1]).to(KERNEL_INPUT_DTYPE)
    y = torch._weight_int8pack_mm(flat, w.q, w.scale)
    return y.view(*x.shape[:-1], w.q.shape[0]).to(x.dtype)


def nbytes(t: torch.Tensor | Int8Weight) -> int:
    return t.nbytes if isinstance(t, Int8Weight) else t.numel() * t.element_size()
