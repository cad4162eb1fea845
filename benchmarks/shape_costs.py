"""Forward costs of random-weight models with real shapes (``ssd bench-costs --shapes``): no model download.

A shape's config comes from the installed GGUF's header (or the installed folder's config), else from
:data:`SHAPES`, which holds what those headers say. Its weights are random (normal, std 0.02; norms 1), written once
in the compute dtype to a temporary folder and loaded by the project's runner, so the timed code is the service's
own. Acceptance does not matter for cost rows.

Per shape and dtype it reports, for the dynamic forward (``eager``) and the static-buffer step (``static``: CUDA
graphs on a GPU, the same buffers without capture elsewhere):
- T(1): one new token after ``context`` cached tokens, packing and upload included;
- V(K) = T(K+1) / T(1);
- batch throughput: ``batch`` requests, one new token each, in tokens per second.
The cache holds zeros where a prompt would have been: what attention costs does not depend on the values.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import torch

from benchmarks.cost_model import median_time
from spec_core.backends.default import static_step
from spec_core.backends.static_step import Buckets
from spec_core.packing import WorkItem, pack
from spec_core.runner import ModelRunner

logger = logging.getLogger(__name__)

#: The real shapes, as the GGUF headers of the shipped and opt-in targets give them; ``tiny`` is for tests.
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True),
    "qwen2.5-coder-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, rope_theta=1e6,
                               rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512, rope_theta=10000.0,
                 rms_norm_eps=1e-5, max_position_embeddings=1024, tie_word_embeddings=True),
}


def header_shape(path: str | Path) -> dict:
    """A shape from a GGUF's header (llama and qwen2 keys): the fields of :data:`SHAPES`."""
    from spec_core.gguf_header import read_header

    header = read_header(path)
    f, tensors = header.fields, {t.name: t for t in header.tensors}
    arch = f["general.architecture"]
    return dict(model_type=arch, hidden_size=f[f"{arch}.embedding_length"],
                intermediate_size=f[f"{arch}.feed_forward_length"], num_hidden_layers=f[f"{arch}.block_count"],
                num_attention_heads=f[f"{arch}.attention.head_count"],
                num_key_value_heads=f[f"{arch}.attention.head_count_kv"],
                vocab_size=tensors["token_embd.weight"].shape[1], rope_theta=float(f[f"{arch}.rope.freq_base"]),
                rms_norm_eps=float(f[f"{arch}.attention.layer_norm_rms_epsilon"]),
                max_position_embeddings=f[f"{arch}.context_length"],
                tie_word_embeddings="output.weight" not in tensors)


def installed_target(name: str) -> Path | None:
    """The installed target of pair ``name`` (a GGUF file or a folder with a config), if any."""
    from spec_core.pairs import PAIRS, pair_paths

    if name not in PAIRS:
        return None
    path = Path(pair_paths(PAIRS[name])["target"])
    return path if path.is_file() or (path / "config.json").is_file() else None


def shape_config(name: str) -> tuple[dict, str]:
    """``(shape, where it came from)``: the installed target's header or config, else :data:`SHAPES`."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")
    path = installed_target(name)
    if path is not None and path.is_file():
        return header_shape(path), f"GGUF header {path.name}"
    if path is not None:
        cfg = json.loads((path / "config.json").read_text())
        theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
        shape = {k: cfg.get(k, v) for k, v in SHAPES[name].items()}
        return {**shape, "rope_theta": float(theta or SHAPES[name]["rope_theta"])}, f"config {path}"
    return dict(SHAPES[name]), "table"


def write_random_model(shape: dict, dtype: torch.dtype, out: Path, seed: int = 0) -> int:
    """An HF folder at ``out`` with ``shape``'s config and random weights in ``dtype``; returns the parameter
    count."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in shape.items() if k not in ("model_type", "rope_theta")}
    config = AutoConfig.for_model(shape["model_type"], **fields, initializer_range=0.02,
                                  rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]})
    with torch.device("meta"):
        names = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, size in names.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(size, dtype=dtype)
        else:
            weights[name] = (torch.randn(size, generator=gen, dtype=torch.float32) * 0.02).to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sum(w.numel() for w in weights.values())


def decode_items(rows: int, context: int, new: int, span: int) -> list[WorkItem]:
    """``rows`` requests of ``context`` cached tokens (row r in slots from ``r * span``), ``new`` tokens each."""
    items = []
    for r in range(rows):
        base = r * span
        slots = list(range(base + context, base + context + new))
        items.append(WorkItem(list(range(base, base + context)), [1] * new, list(range(context, context + new)),
                              slots, new, [], list(range(new))))
    return items


def time_costs(forward, runner: ModelRunner, cache, context: int, k_max: int, batch: int, span: int,
               repeats: int) -> dict:
    """T(1), V(K) for K = 1..k_max and ``batch``-row decode tokens/s of ``forward(cache, batch)``."""
    pad = runner.row_padding()

    def timed(items: list[WorkItem], reps: int) -> float:
        return median_time(lambda: forward(cache, pack(items, cache.scratch_slot, runner.device, pad)),
                           runner.device, reps)

    t1 = timed(decode_items(1, context, 1, span), repeats)
    v = {k: timed(decode_items(1, context, k + 1, span), max(5, repeats // 4)) / t1 for k in range(1, k_max + 1)}
    tb = timed(decode_items(batch, context, 1, span), max(5, repeats // 4))
    return {"t1_s": t1, "V": v, "batch_s": tb, "batch_tokens_per_s": batch / tb}


def measure_shape(name: str, dtype: str, device: str, context: int = 256, k_max: int = 8, batch: int = 64,
                  repeats: int = 200) -> dict:
    """One row: the random-weight model of shape ``name`` in ``dtype`` on ``device``, eager and static."""
    shape, source = shape_config(name)
    torch_dtype = getattr(torch, dtype)
    span = context + k_max + 1
    with tempfile.TemporaryDirectory(prefix=f"shape-{name}-") as tmp:
        params = write_random_model(shape, torch_dtype, Path(tmp))
        runner = ModelRunner(tmp, dtype=torch_dtype, device=device)
    block = 16
    cache = runner.new_paged_cache(batch * -(-span // block), block)
    span = -(-span // block) * block
    buckets = Buckets(max_batch=batch, max_tokens=k_max + 1, max_context=span)
    row = {"shape": name, "config_source": source, "params": params, "dtype": dtype, "device": str(runner.device),
           "context": context, "batch": batch}
    row["eager"] = time_costs(runner.forward_paged, runner, cache, context, k_max, batch, span, repeats)
    step = static_step(runner.forward_paged, cache, buckets)
    row["static"] = {"graphs": runner.device.type == "cuda",
                     **time_costs(step, runner, cache, context, k_max, batch, span, repeats)}
    return row
