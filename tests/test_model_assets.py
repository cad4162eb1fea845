"""Shipped models packed small (:mod:`spec_core.model_assets`): Q8 groups within their own rounding, and an
unpacked folder that is built once and is a plain HF folder."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from spec_core.model_assets import GROUP, dequantize, pack, quantize, unpack


def test_q8_groups_round_within_half_a_step_of_their_group():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 4 * GROUP, generator=g) * torch.logspace(-3, 1, 48)[:, None]).to(torch.bfloat16)
    norm = torch.rand(4 * GROUP, generator=g).to(torch.bfloat16)
    packed = quantize({"w": w, "norm": norm, "odd": torch.zeros(3, 5, dtype=torch.bfloat16)})
    assert packed["w.q8"].dtype == torch.int8 and packed["w.q8scale"].shape == (48, 4)
    back = dequantize(packed)
    assert set(back) == {"w", "norm", "odd"} and all(t.dtype == torch.bfloat16 for t in back.values())
    assert torch.equal(back["norm"], norm) and torch.equal(back["odd"], packed["odd"])  # not matrices: as they are
    step = packed["w.q8scale"].float().repeat_interleave(GROUP, 1)
    err = (back["w"].float() - w.float()).abs()
    assert (err <= 0.5 * step + w.float().abs() / 128).all()  # half a code, plus bf16's own rounding
    assert not torch.equal(back["w"], w)  # it is lossy: a test that could not fail would say nothing


def test_unpack_builds_a_plain_folder_once(tmp_path, monkeypatch, toy_pair):
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "model"
    src.mkdir()
    g = torch.Generator().manual_seed(1)
    save_file({"w": torch.randn(8, GROUP, generator=g).to(torch.bfloat16)}, str(src / "model.safetensors"))
    (src / "tokenizer.json").write_text('{"x": 1}')
    (src / "config.json").write_text("{}")
    packed = pack(src, tmp_path / "packed")
    assert not (packed / "model.safetensors").exists() and (packed / "pack.json").is_file()
    out = unpack(packed)
    assert out.parent == tmp_path / "cache" / "assets" and json.loads((out / "tokenizer.json").read_text()) == {"x": 1}
    w = load_file(str(out / "model.safetensors"))["w"]
    assert w.dtype == torch.bfloat16 and w.shape == (8, GROUP)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert unpack(packed) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp  # built once
