"""``--dtype w8a8``: a target with int8 weights and int8 activations, calibrated at load.

fbgemm's dynamically quantized linear (:class:`spec_core.quant.W8A8Weight`) multiplies in integers on VNNI, so a
decode step costs about half of bf16's and a verify of 5 rows little more than one. But an activation quantized with
one scale per call loses its small channels to the few large ones. SmoothQuant (Xiao et al., 2023) moves that range
into the weights: for each input channel j of a matrix W, s_j = max|x_j|^α / max|W_j|^(1−α), and x/s · (s·W) = x·W
exactly. The 1/s folds into whatever produced x (an RMSNorm's weight, or the V projection for the output
projection), so the model computes the same function in exact arithmetic and only the rounding changes.

- The input ranges come from an fp32 pass over :data:`CALIBRATION` prompts (HumanEval tasks the benchmarks do not
  use), recorded by :class:`spec_core.quant.Observed`.
- q/k/v, the output projection and gate/up run W8A8. The down projection keeps int8 weights with bf16 activations
  (``int8``): its inputs carry the widest outliers, and W8A8 there cost the most agreement with fp32 (greedy prefix
  on 6 HumanEval prompts × 32 tokens: 148/192 so, 119/192 all W8A8, 8/192 without smoothing). The LM head is int8
  as well.
- Like ``int8`` and ``int4``, it is its own numeric model and not batch-invariant (one activation scale covers a
  call's rows): its greedy agreement with fp32 is reported, never assumed.
"""

from __future__ import annotations

import logging
import time

import torch

from spec_core.quant import Observed, quantize_int8, quantize_w8a8

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


def convert(runner, prompts: list[list[int]], alpha: float = ALPHA) -> None:
    """Calibrate a runner with dense fp32 matrices on ``prompts``, fold the smoothing scales, and quantize its
    matrices (module docstring)."""
    if runner.dtype != torch.float32 or not all(isinstance(m, torch.Tensor) for m in runner.weight_matrices()[:-1]):
        raise ValueError("w8a8 converts a runner with dense fp32 matrices")
    t0 = time.perf_counter()
    ranges = input_ranges(runner, prompts)
    for layer, amax in zip(runner.layers, ranges):
        smooth_layer(layer, amax, runner.spec, alpha)
        layer.qkv, layer.o, layer.gate_up = (quantize_w8a8(m) for m in (layer.qkv, layer.o, layer.gate_up))
        layer.down = quantize_int8(layer.down)
    logger.info("w8a8: calibrated on %d prompts and quantized in %.1fs", len(prompts), time.perf_counter() - t0)
