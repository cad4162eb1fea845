"""``--dtype w8a8``: a target with int8 weights and int8 activations, calibrated at load.

fbgemm's dynamically quantized linear (:class:`spec_core.quant.W8A8Weight`) multiplies in integers on VNNI, so a
decode step costs about half of bf16's and a verify of 5 rows little more than one. But an activation quantized with
one scale per call loses its small channels to the few large ones. SmoothQuant (Xiao et al., 2023) moves that range
into the weights: for each input channel j of a matrix W, s_j = max|x_j|^α / max|W_j|^(1−α), and x/s · (s·W) = x·W
exactly. The 1/s folds into whatever produced x (an RMSNorm's weight, or the V projection for the output
projection), so the model computes the same function in exact arithmetic and only the rounding changes.

- The input ranges come from an fp32 pass over :data:`CALIBRATION` prompts (HumanEval tasks the benchmarks do not
  use), recorded by :class:`spec_core.quant.Observed`.
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
- Like ``int8`` and ``int4``, it is its own numeric model and not batch-invariant (one activation scale covers a
  call's rows): its greedy agreement with fp32 is reported, never assumed.
"""

from __future__ import annotations

import logging
import time

import torch

from spec_core.quant import Observed, onednn_bf16, quantize_w8a8, require_w8a8
from spec_core.runner import dense_layout

logger = logging.getLogger(__name__)

#: SmoothQuant's migration strength (0.6 and 0.75 agreed equally with fp32 here; 0.9 lost half).
ALPHA = 0.75
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


def convert(runner, prompts: list[list[int]], alpha: float = ALPHA) -> None:
    """Calibrate a runner with dense fp32 matrices on ``prompts``, fold the smoothing scales, and quantize its
    matrices (module docstring)."""
    if runner.dtype != torch.float32 or not all(isinstance(m, torch.Tensor) for m in runner.weight_matrices()[:-1]):
        raise ValueError("w8a8 converts a runner with dense fp32 matrices")
    require_w8a8(runner.device)
    t0 = time.perf_counter()
    for layer, amax in zip(runner.layers, input_ranges(runner, prompts)):
        smooth_layer(layer, amax, runner.spec, alpha)
        layer.qkv, layer.o, layer.gate_up, layer.down = (quantize_w8a8(getattr(layer, name)) for name in _MATRICES)
    if onednn_bf16():  # the head stays bf16 (module docstring), where oneDNN multiplies bf16; else fp32
        runner.lm_head = dense_layout(runner.lm_head.t().to(torch.bfloat16))
    logger.info("w8a8: calibrated on %d prompts and quantized in %.1fs", len(prompts), time.perf_counter() - t0)
