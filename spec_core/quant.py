"""Weight-only int8 (``--dtype int8``): each weight matrix is stored as int8 with one symmetric scale per output
channel, and multiplied through torch's int8 weight-only kernel (``_weight_int8pack_mm``) with bf16 inputs.

Everything else (embedding rows, norms, RoPE, attention, the KV cache, logits) stays in the runner's compute dtype,
fp32. A token reads a quarter of fp32's weight bytes. It is a different numeric model from fp32, so its greedy
agreement with fp32 is reported, never assumed; the fp32 runner stays the exactness reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


@dataclass(frozen=True, slots=True)
class LinearWeight:
    """A float weight kept as ``w [out, in]`` (``nn.Linear``'s layout) and applied with ``F.linear``.

    The runner keeps fp32 weights transposed (``[in, out]``: ``x @ w_t`` is the fast fp32 CPU path for decode
    rows), but oneDNN's bf16 kernels are fast on this layout instead: about 1.6x for 1-8 rows on AVX512-BF16.
    """

    w: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """The float matrix's shape as the runner's other weights report it, ``[in, out]``."""
        return self.w.shape[1], self.w.shape[0]

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


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


def matmul(x: torch.Tensor, w: torch.Tensor | LinearWeight | Int8Weight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w (+ bias)`` for a float ``[in, out]`` matrix, a :class:`LinearWeight` or an :class:`Int8Weight`;
    the result has ``x``'s dtype."""
    if isinstance(w, torch.Tensor):
        return x @ w if bias is None else torch.addmm(bias, x.flatten(0, -2), w).view(*x.shape[:-1], w.shape[1])
    if isinstance(w, LinearWeight):
        return F.linear(x, w.w, bias)
    if bias is not None:
        return matmul(x, w) + bias
    flat = x.reshape(-1, x.shape[-1]).to(KERNEL_INPUT_DTYPE)
    y = torch._weight_int8pack_mm(flat, w.q, w.scale)
    return y.view(*x.shape[:-1], w.q.shape[0]).to(x.dtype)


def nbytes(t: torch.Tensor | LinearWeight | Int8Weight) -> int:
    return t.nbytes if isinstance(t, (Int8Weight, LinearWeight)) else t.numel() * t.element_size()
