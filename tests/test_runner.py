"""The compact runner's logits equal transformers' (fp32, within 1e-4), through prefill and incremental steps."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from spec_core.runner import ModelRunner

TOL = 1e-4


def _incremental_logits(runner: ModelRunner, ids: torch.Tensor, splits: list[int]) -> torch.Tensor:
    cache = runner.new_cache(1, ids.shape[1] + 4)
    outs, start = [], 0
    for end in splits + [ids.shape[1]]:
        outs.append(runner.forward(cache, ids[:, start:end], torch.arange(start, end)[None]))
        start = end
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama-draft", "qwen3-draft"])
def test_logits_match_transformers_tiny(tiny_models, name):
    path = tiny_models[name]
    ref_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    runner = ModelRunner(path)
    ids = torch.randint(0, runner.vocab_size, (1, 40))
    with torch.no_grad():
        ref = ref_model(ids).logits
    got = _incremental_logits(runner, ids, [17, 18, 25])
    assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize("role", ["target", "draft"])
def test_logits_match_transformers_toy_pair(toy_pair, role):
    path = toy_pair[role]
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(path)
    ids = torch.randint(0, runner.vocab_size, (1, 300))
    with torch.no_grad():
        ref = ref_model(ids).logits
    got = _incremental_logits(runner, ids, [200, 201, 260])
    assert (got - ref).abs().max().item() < TOL


def test_batched_rows_are_independent(tiny_models):
    runner = ModelRunner(tiny_models["llama"])
    a, b = torch.randint(0, 256, (1, 12)), torch.randint(0, 256, (1, 12))
    cache = runner.new_cache(2, 32)
    both = runner.forward(cache, torch.cat([a, b]), torch.arange(12).expand(2, 12))
    single = runner.forward(runner.new_cache(1, 32), b, torch.arange(12)[None])
    assert (both[1] - single[0]).abs().max().item() < TOL


def test_gpu_attention_leaves_out_cudnn_and_restores_the_flags():
    """On CUDA each forward's attention may not pick cuDNN's kernel (a plan build per new shape); the global SDPA
    flags are restored after it, and a CPU forward leaves them alone."""
    from spec_core.runner import attention_kernels

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_kernels(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention_kernels(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.parametrize("family,rope", [
    ("llama", None), ("qwen3", None), ("qwen3", {"rope_type": "linear", "factor": 2.0}),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}),
    ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    ("llama", {"rope_type": "dynamic", "factor": 2.0}),
])
def test_rope_tables_equal_transformers_rotary_module(family, rope):
    """Our RoPE tables (computed without importing transformers' modeling code) equal its rotary modules' bit for
    bit, for the default parameters and the scaled types."""
    from conftest import tiny_config
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from spec_core.ops import rope_tables

    overrides = {"rope_parameters": {"rope_theta": 10000.0, **rope}} if rope else {}
    config = tiny_config(family, **overrides)
    module = (LlamaRotaryEmbedding if family == "llama" else Qwen3RotaryEmbedding)(config)
    cos, sin = module(torch.zeros(1), torch.arange(512)[None])
    ours = rope_tables(config, 512)
    assert torch.equal(ours[0], cos[0]) and torch.equal(ours[1], sin[0])
    if rope and rope["rope_type"] != "dynamic":
        assert not torch.equal(ours[0], rope_tables(tiny_config(family), 512)[0])  # the scaling took effect
