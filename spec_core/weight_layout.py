"""The layout a dense weight matrix is multiplied in, by dtype and device (the runner's and w8a8's head)."""

from __future__ import annotations

import torch

from spec_core.backends.cpu.quant import LinearWeight, PackedLinear, can_prepack


def _t(w: torch.Tensor) -> torch.Tensor:
    """Store a Linear weight transposed (``[in, out]``, contiguous): ``x @ w_t`` is markedly faster than
    ``F.linear(x, w)`` for the few-row products of decoding on CPU in fp32 (about 2x for the LM head)."""
    return w.t().contiguous()


def dense_layout(w: torch.Tensor) -> torch.Tensor | LinearWeight | PackedLinear:
    """The layout a ``[out, in]`` weight (already in its compute dtype) is multiplied in: transposed for fp32,
    prepacked for oneDNN for bf16 on CPU, ``nn.Linear``'s own otherwise (see :mod:`spec_core.backends.cpu.quant`)."""
    if can_prepack(w):
        return PackedLinear.pack(w)
    if w.dtype in (torch.bfloat16, torch.float16):
        return LinearWeight(w.contiguous())
    return _t(w)
