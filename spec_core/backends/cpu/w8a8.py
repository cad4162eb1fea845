"""``--dtype w8a8``: a target with int8 weights and int8 activations, calibrated at load.

fbgemm's dynamically quantized linear (:class:`spec_core.backends.cpu.quant.W8A8Weight`) multiplies in integers on VNNI,
so a decode step costs about half of bf16's and a verify of 5 rows little more than one. But an activation quantized
with one scale per call loses its small channels to the few large ones. SmoothQuant (Xiao et al., 2023) moves that range
into the weights: for each input channel j of a matrix W, s_j = max|x_j|^α / max|W_j|^(1−α), and x/s · (s·W) = x·W
exactly. The 1/s folds into whatever produced x (an RMSNorm's weight, or the V projection for the output projection), so
the model computes the same function in exact arithmetic and only the rounding changes.

- The input ranges come from an fp32 pass over :data:`CALIBRATION` prompts (HumanEval tasks the benchmarks do not
  use), recorded by :class:`spec_core.backends.cpu.quant.Observed`.
- Every layer matrix runs W8A8; the down projection's input is silu(gate)·up, so its scales divide up's columns.
  The LM head stays bf16 (oneDNN, prepacked): W8A8 there cost most of the agreement, and int8 weight-only costs
  more time (3.8 ms at one row and 9.7 at five; bf16's barely grows with the rows). Measured on 6 HumanEval prompts × 32 greedy
  tokens, matching prefix with fp32 and target T(1)/T(5) on one thread:

  | down, head | prefix | T(1), T(5) |
  |---|---|---|
  | W8A8, bf16 (the default) | 136/192 | 18.0, 20.5 ms |
  | W8A8, W8A8 | 17/192 | 15.3, 19.6 ms |
  | W8A8, int8 | 110/192 | 17.7, 27.6 ms |
  | int8, int8 | 147/192 | 19.4, 32.2 ms |
  | bf16, bf16 | 153/192 | 23.4, 24.6 ms |

  Without smoothing, all W8A8 with an int8 head matched 8/192.
- Like ``int8`` and ``int4``, it is its own numeric model: its greedy agreement with fp32 is reported, never
  assumed. Through fbgemm it is not batch-invariant (one activation scale covers a call's rows).

Two kernels (:func:`row_gemm` picks). Where fbgemm multiplies on VNNI, the table above (an AVX-512 VNNI machine) holds.
On x86 CPUs without VNNI, fbgemm keeps only 7 bits of each activation, so the matrices, the head included, run the
compiled kernel of ``kernels/quant_gemm.c`` (:class:`spec_core.backends.cpu.quant.RowW8A8Weight`): a scale per block of
32 of each row, all 8 bits, and a forward that is batch-invariant (SD and SSD equal w8a8's own AR token for token).
Measured on an AVX2 EPYC, 6 HumanEval prompts × 64 greedy tokens, prefix matching fp32: fbgemm with an fp32 head 92/384,
one scale per row 109/384, a scale per block (α = 0.6) 231/384; T(1) 24.2 against 15.2 ms (per row).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from spec_core.backends.cpu.quant import (
    Observed,
    onednn_bf16,
    pack_w8a8_rows,
    quantize_w8a8,
    require_w8a8,
    w8a8_reduce_range,
)
from spec_core.weight_layout import dense_layout

logger = logging.getLogger(__name__)

#: SmoothQuant's migration strength for fbgemm (0.6 and 0.75 agreed equally with fp32 here; 0.9 lost half).
ALPHA = 0.75
#: ... and for the compiled kernel, whose activation scales per block of 32 need less of it: greedy prefix agreement
#: with fp32 on 6 HumanEval prompts x 64 tokens (AVX2 EPYC) was 206, 231, 166 and 105 of 384 at 0.5, 0.6, 0.75, 0.85.
ROW_ALPHA = 0.6
#: Calibration prompts: HumanEval tasks 10-19 (the benchmarks use the first ones) and, where the tokenizer has a
#: chat template, the last 6 prompts of the chat set.
CALIBRATION = (range(10, 20), 6)
_MATRICES = ("qkv", "o", "gate_up", "down")


def calibration_ids(tokenizer) -> list[list[int]]:
    """The token ids of the calibration prompts for ``tokenizer``."""
    from spec_core.chat import encode
    from spec_core.prompts import chat_prompts, humaneval_prompts

    tasks, n_chat = CALIBRATION
    code = humaneval_prompts(max(tasks) + 1)
    prompts = [code[i] for i in tasks]
    if getattr(tokenizer, "chat_template", None):
        prompts += chat_prompts()[-n_chat:]
    return [encode(tokenizer, p) for p in prompts]


def input_ranges(runner, prompts: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Each layer's largest |x| per input channel of each matrix, over fp32 prefills of ``prompts``."""
    for layer in runner.layers:
        for name in _MATRICES:
            setattr(layer, name, Observed(getattr(layer, name)))
    try:
        for ids in prompts:
            cache = runner.new_cache(1, len(ids))
            runner.forward(cache, torch.tensor([ids]), torch.arange(len(ids))[None])
    finally:
        ranges = []
        for layer in runner.layers:
            ranges.append({name: getattr(layer, name).amax for name in _MATRICES})
            for name in _MATRICES:
                setattr(layer, name, getattr(layer, name).w)
    return ranges


def smoothing(w_t: torch.Tensor, amax: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel scale s for a ``[in, out]`` weight whose inputs reach ``amax``."""
    return amax.clamp(min=1e-5) ** alpha / w_t.abs().amax(1).clamp(min=1e-5) ** (1 - alpha)


def _divided(norm, s: torch.Tensor):
    """An RMSNorm (:class:`spec_core.ops.RMSNorm`) whose weight is divided by ``s``, in the same form."""
    return type(norm).build(norm.weight / s, norm.eps, fused=norm.doubled is not None)


def smooth_layer(layer, amax: dict[str, torch.Tensor], spec, alpha: float = ALPHA) -> None:
    """Fold smoothing scales into one layer's fp32 weights (``[in, out]``) and norms: the same function in exact
    arithmetic. The output projection's scales are shared by the query heads of one K/V head (GQA), as the V
    channel they divide is."""
    s = smoothing(layer.qkv, amax["qkv"], alpha)
    layer.qkv = layer.qkv * s[:, None]
    layer.ln_attn = _divided(layer.ln_attn, s)
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    s_kv = smoothing(layer.o, amax["o"], alpha).view(kv_heads, heads // kv_heads, dim).amax(1)  # [kv_heads, D]
    layer.o = layer.o * s_kv[:, None, :].expand(kv_heads, heads // kv_heads, dim).reshape(-1)[:, None]
    v_cols = slice((heads + kv_heads) * dim, None)
    layer.qkv[:, v_cols] /= s_kv.reshape(-1)[None, :]
    if layer.qkv_bias is not None:
        layer.qkv_bias = layer.qkv_bias.clone()
        layer.qkv_bias[v_cols] /= s_kv.reshape(-1)
    s = smoothing(layer.gate_up, amax["gate_up"], alpha)
    layer.gate_up = layer.gate_up * s[:, None]
    layer.ln_mlp = _divided(layer.ln_mlp, s)
    s = smoothing(layer.down, amax["down"], alpha)  # the down projection's input is silu(gate) * up
    layer.down = layer.down * s[:, None]
    layer.gate_up[:, layer.gate_up.shape[1] // 2:] /= s[None, :]


def row_kernel_available() -> bool:
    """Whether a runner with the CPU kernels multiplies w8a8 through the compiled matmul: where it is built with
    SIMD and fbgemm would keep 7 bits of each activation (x86 without VNNI)."""
    from spec_core.backends.cpu import cpu_kernels

    return w8a8_reduce_range() and cpu_kernels.quant_gemm() is not None


def row_gemm(runner):
    """The compiled W8A8 matmul with a scale per row (:class:`spec_core.backends.cpu.quant.RowW8A8Weight`) where
    ``runner`` uses the CPU kernels and :func:`row_kernel_available`, else None (fbgemm)."""
    from spec_core.backends.cpu import cpu_kernels

    return cpu_kernels.quant_gemm().w8a8 if runner.kernels is not None and row_kernel_available() else None



def convert(runner, prompts: list[list[int]], alpha: float | None = None, gemm=None) -> None:
    """Calibrate a runner with dense fp32 matrices on ``prompts``, fold the smoothing scales, and quantize its
    matrices (module docstring): for ``gemm`` (:func:`row_gemm`) where given, else for fbgemm."""
    if runner.dtype != torch.float32 or not all(isinstance(m, torch.Tensor) for m in runner.weight_matrices()[:-1]):
        raise ValueError("w8a8 converts a runner with dense fp32 matrices")
    require_w8a8(runner.device)
    quantize = quantize_w8a8 if gemm is None else functools.partial(pack_w8a8_rows, gemm=gemm)
    if alpha is None:
        alpha = ALPHA if gemm is None else ROW_ALPHA
    t0 = time.perf_counter()
    for layer, amax in zip(runner.layers, input_ranges(runner, prompts)):
        smooth_layer(layer, amax, runner.spec, alpha)
        layer.qkv, layer.o, layer.gate_up, layer.down = (quantize(getattr(layer, name)) for name in _MATRICES)
    if gemm is not None:  # the head too: the whole forward batch-invariant, and nearer fp32 than an fp32 head here
        runner.lm_head = quantize(runner.lm_head)
    elif onednn_bf16():  # the head stays bf16 (module docstring), where oneDNN multiplies bf16; else fp32
        runner.lm_head = dense_layout(runner.lm_head.t().to(torch.bfloat16))
    logger.info("w8a8: calibrated on %d prompts and quantized in %.1fs", len(prompts), time.perf_counter() - t0)
