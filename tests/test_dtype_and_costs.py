"""``--dtype auto`` (the default of every command), ``ssd bench-costs`` honouring its flags, and the bench's
equal-hardware and peer modes (``ar-2t``, ``llama-cpp``, ``llama-cpp-2t``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from spec_core.config import ModelConfig, native_bf16, resolve_dtype


def ssd(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ssd_cli", *args], capture_output=True, text=True, timeout=timeout)


def test_auto_resolves_by_device():
    expected = "bfloat16" if native_bf16("cpu") else "float32"
    assert resolve_dtype("auto", "cpu") == expected
    assert ModelConfig("x", dtype="auto").resolved_dtype == expected
    assert resolve_dtype("fp32") == "float32" and resolve_dtype("bf16") == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3")


def test_generate_defaults_to_auto(real_pair):
    proc = ssd("generate", "--prompt", "def add(a, b):", "--mode", "ar", "--max-new-tokens", "4", "--ignore-eos",
               "--json", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    # the default target is a 4-bit GGUF: auto runs its own int4 where the compiled kernels run
    assert json.loads(proc.stdout)["dtype"] == ModelConfig(real_pair["target"], "auto").resolved_dtype
    bad = ssd("generate", "--prompt", "x", "--dtype", "int3")
    assert bad.returncode == 2 and "unknown dtype" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_costs_honours_dtype_threads_and_records_both_rows(toy_pair, report):
    """On the toy pair: bf16 without native support (AVX2-only CPUs) is emulated and very slow on the real one."""
    import torch

    from spec_core.backends.cpu import cpu_kernels

    proc = ssd("bench-costs", "--dtype", "float32,bfloat16,int8,int4", "--repeats", "3", "--k-max", "2", "--threads", "1",
               "--context", "32", "--no-busy-core", "--target", toy_pair["target"], "--draft", toy_pair["draft"])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = {r["dtype"]: r for r in out["rows"]}
    assert list(rows) == ["float32", "bfloat16", "int8", "int4"]
    f32, b16, i8, i4 = rows["float32"], rows["bfloat16"], rows["int8"], rows["int4"]
    for r in (f32, b16, i8, i4):
        assert r["threads"] == 1 and r["device"] == "cpu"
        # the floor streams the weights from memory; a model that fits the last-level cache may beat it (the toy
        # int4's 12 MB ran 0.89 ms against a 0.99 ms floor on a VM with a 480 MiB L3)
        assert 0 < r["floor_t1_s"] and 0 < r["target_t1_s"] and 0 < r["target_matmul_t1_s"]
        assert set(r["V"]) == {"1", "2"}
        assert r["target_t1_other_core_busy_s"] is None  # --no-busy-core
    assert f32["floor_t1_s"] > b16["floor_t1_s"] > i4["floor_t1_s"]  # each floor is its own dtype's bytes
    # the weights really are loaded in each dtype: half the bytes per token in bf16
    assert f32["weight_bytes_per_token"] == 2 * b16["weight_bytes_per_token"]
    assert 3.5 * i8["weight_bytes_per_token"] < f32["weight_bytes_per_token"]  # int8 matrices, fp32 norms/scales
    assert i4["weight_bytes_per_token"] < 0.75 * i8["weight_bytes_per_token"]  # 4-bit matrices, an int8 head
    assert f32["target_t1_s"] != b16["target_t1_s"]
    assert f32["target_t1_rows"] == 1  # the fp32 reference is never padded (spec_core.backends.cpu.row_padding)
    assert all(1 <= r["target_t1_rows"] <= 8 and r["target_matmul_one_row_s"] > 0 for r in (b16, i8, i4))
    assert not f32["cpu_kernels"]  # the reference keeps transformers' arithmetic (spec_core.backends.cpu.cpu_kernels)
    assert all(r["cpu_kernels"] == (cpu_kernels.load(torch.float32) is not None) for r in (b16, i8, i4))
    from spec_core.config import weight_format

    assert all(r["draft_weights"] == weight_format(r["draft_dtype"]) for r in (f32, b16, i8, i4))  # w8a8 is a format
    for r in (f32, b16, i8, i4):
        report(f"bench-costs {r['dtype']}: T(1) {r['target_t1_s'] * 1e3:.1f} ms as {r['target_t1_rows']} row(s), "
               f"matmuls alone "
               f"{r['target_matmul_t1_s'] * 1e3:.1f} ms, floor {r['floor_t1_s'] * 1e3:.1f} ms, "
               f"V(2) {r['V']['2']:.2f} (3 repeats, context 32, not asserted)")
    bad = ssd("bench-costs", "--dtype", "float32,int3")
    assert bad.returncode == 2 and "unknown dtype" in bad.stderr
    plain = ssd("bench-costs", "--dtype", "bfloat16", "--no-pad-rows", "--no-cpu-kernels", "--repeats", "2", "--k-max",
                "1", "--context", "16", "--target", toy_pair["target"], "--draft", toy_pair["draft"])
    assert plain.returncode == 0, plain.stderr
    row = json.loads(plain.stdout)["rows"][0]
    assert row["target_t1_rows"] == 1 and row["target_matmul_t1_s"] == row["target_matmul_one_row_s"]
    assert not row["cpu_kernels"]
    if (os.cpu_count() or 1) > 1:  # by default, T(1) with the draft running on the other core
        assert row["target_t1_other_core_busy_s"] > 0


def test_bench_quick_equal_hardware_and_peer_modes(tmp_path):
    out = tmp_path / "bench.json"
    proc = ssd("bench", "--quick", "--num-prompts", "1", "--modes", "ar,ar-2t,llama-cpp,llama-cpp-2t", "--dtype",
               "float32", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["settings"]["dtype"] == "float32"
    required = {"mode", "concurrency", "temperature", "tokens_per_s", "ttft_s_p50", "itl_s_p50", "itl_s_p99",
                "mean_tokens_per_round", "acceptance_rate", "cache_hit_rate", "matches_target_greedy",
                "target_threads"}
    rows = {r["mode"]: r for r in report["results"]}
    assert set(rows) == {"ar", "ar-2t", "llama-cpp", "llama-cpp-2t"}
    for row in rows.values():
        assert required <= set(row), required - set(row)
    assert rows["ar-2t"]["tokens_per_s"] > 0 and rows["ar-2t"]["target_threads"] == 2
    assert rows["ar-2t"]["matches_target_greedy"] is True
    from benchmarks.llama_cpp_build import binary

    if importlib.util.find_spec("llama_cpp") is None and binary("llama-completion") is None:  # never in CI
        for m in ("llama-cpp", "llama-cpp-2t"):
            assert "`make llama-cpp`" in rows[m]["skipped"] and rows[m]["tokens_per_s"] is None
        assert "skipping llama-cpp, llama-cpp-2t" in proc.stderr
    else:
        assert rows["llama-cpp"]["tokens_per_s"] > 0 and rows["llama-cpp-2t"]["target_threads"] == 2


def test_int8_weights_are_per_channel_symmetric():
    import torch

    from spec_core.backends.cpu.quant import dequantize, matmul, quantize_int8

    gen = torch.Generator().manual_seed(3)
    w_t = torch.randn(96, 40, generator=gen)  # [in, out], as the runner stores it
    q = quantize_int8(w_t)
    assert q.shape == (96, 40) and q.q.dtype == torch.int8 and q.nbytes < w_t.numel() * 4 / 3.5
    step = w_t.abs().amax(0) / 127  # one scale per output channel
    assert ((dequantize(q) - w_t).abs() <= step * (1 + 2**-6) / 2).all()
    x = torch.randn(3, 5, 96, generator=gen)
    ref = x.to(torch.bfloat16).float() @ dequantize(q)
    got = matmul(x, q)
    assert got.shape == (3, 5, 40) and got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    with pytest.raises(ValueError, match="unknown weight format"):
        from spec_core.runner import ModelRunner

        ModelRunner("unused", weights="int3")


def _q4_1_matrix(gen, out: int, inp: int):
    """A ``[in, out]`` matrix holding Q4_1 values, as a dequantized GGUF does: w = d·q + m per 32 inputs."""
    import torch

    q = torch.randint(0, 16, (out, inp // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # ggml's own quantizer puts each block's min at 0 and its max at 15
    d = (torch.rand(out, inp // 32, 1, generator=gen) * 0.02).to(torch.bfloat16).float()
    m = (-torch.rand(out, inp // 32, 1, generator=gen) * 0.1).to(torch.bfloat16).float()
    return (d * q + m).view(out, inp).t(), q.view(out, inp)


def test_int4_recovers_q4_1_codes_and_multiplies_by_them():
    import torch

    from spec_core.backends.cpu.quant import INT4_GROUP, dequantize_int4, matmul, quantize, quantize_int4

    gen = torch.Generator().manual_seed(4)
    w_t, codes = _q4_1_matrix(gen, 48, 96)
    q = quantize_int4(w_t)
    assert q.shape == (96, 48) and q.nbytes == 96 * 48 // 2 + (96 // INT4_GROUP) * 48 * 2 * 2
    # the Q4_1 values come back to within the kernel's bf16 scale/zero rounding
    back = dequantize_int4(q)
    assert (back - w_t).abs().max() < 2e-3, (back - w_t).abs().max()
    # ... and the codes themselves are the file's
    assert torch.equal(q.packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
    # an arbitrary float matrix: within half a step of its group's (max - min) / 15
    w = torch.randn(64, 32, generator=gen)
    g = w.t().reshape(32, 2, 32)
    step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, dim=1).t()
    assert ((dequantize_int4(quantize_int4(w)) - w).abs() <= step / 2 + 0.02 * step.max()).all()
    x = torch.randn(2, 3, 96, generator=gen)
    got = matmul(x, quantize(w_t, "int4"))
    ref = x.to(torch.bfloat16).float() @ back
    assert got.shape == (2, 3, 48) and got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()
    for bad in (torch.randn(40, 16), torch.randn(32, 8)):
        with pytest.raises(ValueError, match="divisible by 32 and output sizes by 16"):
            quantize_int4(bad)


def test_weight_formats_give_the_draft_int4_through_the_kernels_or_float():
    from spec_core.backends.cpu import cpu_kernels
    from spec_core.config import draft_dtype, parse_dtype, weight_format

    weight_draft = "int4" if cpu_kernels.quant_gemm() is not None else "auto"  # the compiled kernels', else auto
    assert draft_dtype("int4") == draft_dtype("int8") == draft_dtype("w8a8") == weight_draft
    assert draft_dtype("int4", kernels=False) == "auto"
    assert draft_dtype("bfloat16") == "bfloat16" and draft_dtype("auto") == "auto"
    assert str(parse_dtype("int4")) == "torch.float32" and weight_format("int4") == "int4"
    assert str(parse_dtype("w8a8")) == "torch.float32" and weight_format("w8a8") == "w8a8"


def test_bf16_weights_are_prepacked_and_match_f_linear_bit_for_bit(toy_pair):
    """bf16 on CPU multiplies by weights reordered once for oneDNN: the same bits as ``F.linear`` (the bf16 model
    is unchanged, only faster), with bias, 3-D inputs, and a way back for the weight-only formats."""
    import torch
    import torch.nn.functional as F

    from spec_core.backends.cpu.quant import (
        LinearWeight,
        PackedLinear,
        can_prepack,
        matmul,
        nbytes,
        onednn_bf16,
        quantize,
    )
    from spec_core.runner import ModelRunner

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 96, generator=gen).to(torch.bfloat16)  # [out, in]
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    assert can_prepack(w) == onednn_bf16() and not can_prepack(w.float())
    if not can_prepack(w):
        pytest.skip("oneDNN has no bf16 path on this CPU (it needs AVX512 BW/VL/DQ or AVX-NE-CONVERT)")
    p = PackedLinear.pack(w)
    assert p.shape == (96, 48) and nbytes(p) == w.numel() * 2 and torch.equal(p.dense(), w)
    for x in (torch.randn(1, 96, generator=gen), torch.randn(2, 5, 96, generator=gen)):
        x = x.to(torch.bfloat16)
        assert torch.equal(matmul(x, p), F.linear(x, w)) and torch.equal(matmul(x, p, bias), F.linear(x, w, bias))
    assert torch.equal(quantize(p, "int8").q, quantize(LinearWeight(w), "int8").q)
    runner = ModelRunner(toy_pair["target"], dtype=torch.bfloat16)
    assert all(isinstance(m, PackedLinear) for m in runner.weight_matrices())
    ids = torch.randint(0, runner.vocab_size, (2, 7), generator=gen)
    pos = torch.arange(7).expand(2, 7)
    packed = runner.forward(runner.new_cache(2, 16), ids, pos)
    for layer in runner.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, LinearWeight(getattr(layer, name).dense()))
    runner.lm_head = LinearWeight(runner.lm_head.dense())
    assert torch.equal(packed, runner.forward(runner.new_cache(2, 16), ids, pos))
