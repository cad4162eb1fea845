"""The ``ssd`` CLI through its real console entry (subprocesses): JSON contract and one-line errors."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from spec_core.prompts import humaneval_prompts


def ssd(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ssd_cli", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ssd: error:") and needle in lines[0], lines[0]


def test_models_prints_default_pair(real_pair):
    proc = ssd("models")
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == real_pair


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_generate_json(mode):
    proc = ssd("generate", "--prompt", humaneval_prompts(1)[0], "--mode", mode, "--max-new-tokens", "24",
               "--ignore-eos", "--json", "--threads", "1", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mode"] == mode and out["num_generated"] == 24 == len(out["token_ids"])
    assert isinstance(out["text"], str) and out["tokens_per_s"] > 0
    if mode == "sd":
        assert out["num_rounds"] >= 1 and out["mean_tokens_per_round"] >= 1
        assert 0 <= out["acceptance_rate"] <= 1


@pytest.mark.parametrize("dtype", ["float32", "w8a8"])
def test_generate_greedy_modes_agree(toy_pair, dtype):
    """AR, and SD and SSD with adaptive K (the default, as ssd serve runs them) and with --fixed-k, agree token for
    token: in fp32 (transformers' arithmetic), and on w8a8 where its forward is batch-invariant (the compiled kernel
    with a scale per row, on x86 without VNNI)."""
    if dtype == "w8a8":
        from spec_core.backends.cpu import cpu_kernels
        from spec_core.backends.cpu.quant import can_w8a8, w8a8_reduce_range

        if not (can_w8a8() and cpu_kernels.quant_gemm() is not None and w8a8_reduce_range()):
            pytest.skip("w8a8 is batch-invariant with the compiled kernel on x86 CPUs without VNNI")
    pair = ["--target", toy_pair["target"], "--draft", toy_pair["draft"], "--dtype", dtype]
    runs = {"ar": ["--mode", "ar"], "sd": ["--mode", "sd"], "sd-fixed": ["--mode", "sd", "--fixed-k"],
            "ssd": ["--mode", "ssd", "--k", "3"],
            "ssd-fixed": ["--mode", "ssd", "--k", "3", "--fixed-k"]}
    if dtype == "w8a8":  # for the suite's time: the planned modes only
        runs = {name: flags for name, flags in runs.items() if "fixed" not in name}
    outs = {name: json.loads(ssd("generate", "--prompt", "def add(a, b):", *flags, "--max-new-tokens", "32",
                                 "--json", "--threads", "1", *pair).stdout) for name, flags in runs.items()}
    assert all(o["token_ids"] == outs["ar"]["token_ids"] for o in outs.values())
    # rounds that proposed nothing: planned plain, or a miss whose n-gram backup found no match
    assert 0 <= outs["ssd"]["plain_round_fraction"] <= 1
    if "ssd-fixed" in outs:
        assert 0 <= outs["ssd-fixed"]["plain_round_fraction"] < 1


def test_bad_model_path():
    assert_one_line_error(ssd("generate", "--prompt", "x", "--target", "/no/such/model"), "not found")


def test_vocabulary_mismatch(tiny_models, toy_pair):
    proc = ssd("generate", "--prompt", "x", "--target", toy_pair["target"], "--draft",
               str(tiny_models["llama-vocab300"]))
    assert_one_line_error(proc, "vocabular")


@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-0.5"], "temperature"),
    (["--temperature", "nan"], "temperature"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--max-new-tokens", "-3"], "max_new_tokens"),
    (["--top-p", "0"], "top_p"),
    (["--mode", "bogus"], "mode"),
])
def test_bad_values(flags, needle):
    assert_one_line_error(ssd("generate", "--prompt", "x", *flags), needle)


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "x", "--temperature", "-1"],
    ["generate", "--prompt", "x", "--target", "/no/such/model"],
    ["batch", "--input", "/no/such/file.jsonl", "--output", "/tmp/never.jsonl"],
])
def test_bad_input_fails_before_torch_is_imported(argv):
    """Flags, model paths and input files are checked first: an error costs a fraction of a second, not a load."""
    code = ("import sys; from ssd_cli.main import main; rc = main(sys.argv[1:]); "
            "sys.exit(rc if 'torch' not in sys.modules and 'transformers' not in sys.modules else 99)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("ssd: error:"), proc.stderr


def test_missing_prompt_and_file():
    assert_one_line_error(ssd("generate"), "prompt")
    assert_one_line_error(ssd("generate", "--prompt-file", "/no/such/file"), "not found")


def test_bench_quick_schema(tmp_path, toy_pair):
    """The report's schema and plots (on the toy pair, for time; the real pair's bench: test_dtype_and_costs)."""
    out = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    proc = ssd("bench", "--quick", "--modes", "ar,sd,ar-2t", "--concurrency", "1,2", "--out", str(out), "--plots", str(plots),
               "--dtype", "float32", "--draft-dtype", "bfloat16", "--target", toy_pair["target"], "--draft",
               toy_pair["draft"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert set(report) >= {"hardware", "settings", "results"}
    assert report["settings"]["draft_dtype"] == "bfloat16"  # a bf16 draft; the fp32 output below stays exact
    required = {"mode", "runtime", "concurrency", "temperature", "tokens_per_s", "ttft_s_p50", "itl_s_p50", "itl_s_p99",
                "mean_tokens_per_round", "acceptance_rate", "cache_hit_rate", "matches_target_greedy"}
    modes = set()
    for row in report["results"]:
        assert required <= set(row), required - set(row)
        assert row["tokens_per_s"] > 0
        assert row["matches_target_greedy"] is True
        assert row["runtime"] == "verifier-engine"  # AR and SD at every concurrency: the one engine
        modes.add((row["mode"], row["concurrency"]))
        if row["mode"] == "ar-2t" and row["concurrency"] > 1:  # equal hardware at every concurrency
            assert "2 threads on both cores" in row["batching"]
        # every run's tokens/s, and the median of each run's ratio to AR's run of the same prompt and repeat
        assert len(row["runs"]) == row["num_runs"] and all(r["tokens_per_s"] > 0 for r in row["runs"])
        ratios = [r["tokens_per_s"] / ar["tokens_per_s"] for r in row["runs"] for ar in _runs_of(report, "ar", row)
                  if (ar.get("prompt"), ar["repeat"]) == (r.get("prompt"), r["repeat"])]
        assert row["x_ar_paired_median"] == pytest.approx(statistics.median(ratios))
        if row["mode"] == "ar":
            assert row["x_ar_paired_median"] == 1.0
        # what each row ran: dtypes, cores, the draft's link
        ran = {"ar": ("float32", None, 1, None), "sd": ("float32", "bfloat16", 1, "in-process"),
               "ar-2t": ("float32", None, 2, None)}[row["mode"]]
        assert (row["dtype"], row["draft_dtype"], row["cores"], row["link"]) == ran and row["lending"] is False
    assert "float32/bfloat16, 1 core, in-process" in proc.stdout and "WARNING" not in proc.stderr
    assert modes == {(m, c) for m in ("ar", "sd", "ar-2t") for c in (1, 2)}
    assert sorted(p.name for p in plots.iterdir()) == ["acceptance_and_hits.png", "tokens_per_s_T0.png"]


def _runs_of(report: dict, mode: str, like: dict) -> list[dict]:
    return next(r["runs"] for r in report["results"] if r["mode"] == mode
                and (r["temperature"], r["concurrency"]) == (like["temperature"], like["concurrency"]))


@pytest.mark.slow  # a benchmark
def test_bench_sweep_reports_the_best_budget(tmp_path, toy_pair):
    """The sweep machinery (on the toy pair; the pair loads once for all points)."""
    out = tmp_path / "sweep.json"
    proc = ssd("bench", "--quick", "--num-prompts", "1", "--max-new-tokens", "32", "--modes", "ssd", "--k", "2",
               "--sweep", "budget", "--out", str(out), "--target", toy_pair["target"], "--draft", toy_pair["draft"])
    assert proc.returncode == 0, proc.stderr
    sweep = json.loads(out.read_text())["sweep"]
    assert [r["budget"] for r in sweep["budget"]] == [4, 8, 12, 16, 24]
    assert all(r["matches_target_greedy"] is True for r in sweep["budget"])
    assert all(0 < r["branches_per_bundle"] <= r["budget"] for r in sweep["budget"]), sweep["budget"]
    best = max(sweep["budget"], key=lambda r: r["tokens_per_s"])
    assert sweep["best_budget"] == best["budget"]
    bad = ssd("bench", "--quick", "--sweep", "k,temperature")
    assert bad.returncode == 2 and "--sweep" in bad.stderr


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_batch_modes_agree_in_input_order(tmp_path, toy_pair):
    """`ssd batch` through the real CLI: AR, SD (chain and tree) and local two-process SSD give identical greedy
    outputs, in input order, with the documented fields (toy pair, for time; the real pair's batch path:
    test_real_pair)."""
    rows = [{"id": f"p{i}", "prompt": p, "max_new_tokens": 16 + 4 * i, "ignore_eos": True}
            for i, p in enumerate(humaneval_prompts(5))]
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, rows)
    outs = {}
    for name, flags in {"ar": ["--mode", "ar"], "sd": ["--mode", "sd"],
                        "tree": ["--mode", "sd", "--k", "3", "--branching", "2"],
                        "ssd": ["--mode", "ssd", "--k", "2"]}.items():
        dst = tmp_path / f"{name}.jsonl"
        proc = ssd("batch", "--input", str(src), "--output", str(dst), "--concurrency", "3", "--threads", "1",
                   "--dtype", "float32", "--target", toy_pair["target"], "--draft", toy_pair["draft"], *flags)
        assert proc.returncode == 0, proc.stderr
        outs[name] = [json.loads(line) for line in dst.read_text().splitlines()]
    for name, res in outs.items():
        assert [r["id"] for r in res] == [r["id"] for r in rows], name
        assert [r["num_generated"] for r in res] == [r["max_new_tokens"] for r in rows], name
        assert [r["token_ids"] for r in res] == [r["token_ids"] for r in outs["ar"]], name
        assert {"id", "text", "token_ids", "num_generated", "finish_reason"} <= set(res[0])


@pytest.mark.parametrize("line,needle", [
    ("not json", "not valid JSON"),
    ('{"prompt": ""}', "prompt"),
    ('{"prompt": "x", "temperature": -1}', "temperature"),
    ('{"prompt_token_ids": [1, 99999999]}', "vocabulary"),
    ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "def f(x):"}', "duplicate id 'a' (first used on line 1)"),
])
def test_batch_bad_input(tmp_path, line, needle):
    src = tmp_path / "in.jsonl"
    src.write_text(line + "\n")
    assert_one_line_error(ssd("batch", "--input", str(src), "--output", str(tmp_path / "o.jsonl")), needle)
    assert not (tmp_path / "o.jsonl").exists()


def test_generated_batch_ids_never_equal_a_users():
    from verifier_service.batch_requests import assign_ids

    assert assign_ids([None, "x", None], [1, 2, 3]) == ["0", "x", "2"]
    assert assign_ids([None, "0", None, "line-1"], [1, 2, 4, 5]) == ["line-1-2", "0", "2", "line-1"]


def test_demo_prints_every_row_the_dtype_and_the_identity_line():
    """The demo (fp32 here: the exact reference, so the identity line must say yes) prints the CPU class and the
    dtype, AR on one and two cores, SD and SSD with their ratios to AR, the equal-hardware ratio and a verdict."""
    from spec_core.hardware import cpu_class

    proc = ssd("demo", "--max-new-tokens", "16", "--dtype", "float32", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"({cpu_class()}, " in out and "dtype float32 (draft " in out
    lines = out.splitlines()
    table = lines[[i for i, line in enumerate(lines) if line.startswith("mode ")][0] + 1:][:4]
    rows = {line.split("  ")[0].strip(): line for line in table}
    assert set(rows) == {"AR", "AR on two cores", "SD", "SSD"}, out
    assert rows["AR"].split()[1:4] == ["1", rows["AR"].split()[2], "1.00"]
    assert "equal hardware: SSD " in out and "greedy outputs identical: yes (AR, AR on two cores, SD, SSD)" in out
    assert "SSD pays here" in out or "Speculation does not pay for this request in float32" in out
    # SD and SSD plan K as ssd serve does (the service's planner), and say how often they drafted nothing
    assert sum("(adaptive k <= 3, no draft on " in line for line in out.splitlines()) == 2, out


def test_demo_verdict_says_plainly_when_speculation_loses_on_equal_hardware():
    from benchmarks.demo import DemoReport, DemoRow, format_demo

    def report(ssd: float) -> str:
        rows = tuple(DemoRow(m, label, c, tps, (tps,), 1.0, "") for m, label, c, tps in (
            ("ar", "AR", 1, 100.0), ("ar-2t", "AR on two cores", 2, 150.0), ("sd", "SD", 1, 90.0),
            ("ssd", "SSD", 2, ssd)))
        return format_demo(DemoReport("q", "a", "cpu", "int4", "w8a8", 16, 3, rows, identical=True))

    lose, slower, win = report(120.0), report(90.0), report(180.0)
    assert "equal hardware: SSD 0.80x AR on the same two cores" in lose
    assert "Speculation does not pay for this request in int4 on this CPU" in lose and "1.25x faster" in lose
    assert "comes from its second core" in lose and "second core" not in slower.split("\n")[-2]
    assert "SSD runs at 0.90x one-core AR and 0.60x AR on the same two cores" in slower
    assert "SSD pays here: 1.20x plain decoding on the same two cores, 1.80x on one." in win
