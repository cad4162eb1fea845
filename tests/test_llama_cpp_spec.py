"""The llama.cpp peer modes without llama.cpp: the parse of its real output (tests/data/llama_cpp, captured from the
binaries ``make llama-cpp`` builds), and ``ssd bench``'s ``llama-cpp-spec`` and binary ``llama-cpp-2t`` rows run
against stub binaries that print that format; garbage output must fail the bench, and an absent binary skips the
mode with one line."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from benchmarks.llama_cpp_output import LlamaCppOutputError, parse_completion_output, parse_spec_output
from benchmarks.llama_cpp_spec import N_MAX_SWEEP, P_MIN, spec_stats

DATA = Path(__file__).parent / "data" / "llama_cpp"

#: a stub of both binaries: it logs its argv and prints llama.cpp's summary lines, fastest at n-max 4
STUB = r'''
import json, os, sys
args = sys.argv[1:]
with open(os.environ["LLAMA_STUB_LOG"], "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0]), *args]) + "\n")
if os.environ.get("LLAMA_STUB_GARBAGE"):
    print("main: model loaded\nsegments: 3\nthat is all")
    sys.exit(0)
n = int(args[args.index("-n") + 1])
prompt_tokens = len(args[args.index("-p") + 1].split())
p = "0.01.946.181 I "
if os.path.basename(sys.argv[0]) == "llama-completion":
    print("generated text")
    print(p + "common_perf_print: prompt eval time =     243.69 ms / %5d tokens (   18.75 ms per token,    53.35 "
          "tokens per second)" % prompt_tokens, file=sys.stderr)
    print(p + "common_perf_print:        eval time = %10.2f ms / %5d runs   (%8.2f ms per token, %8.2f tokens per "
          "second)" % ((n - 1) * 50.0, n - 1, 50.0, 20.0), file=sys.stderr)
    sys.exit(0)
n_max = int(args[args.index("--spec-draft-n-max") + 1])
speed = {2: 10.0, 3: 12.0, 4: 15.0, 6: 11.0, 8: 9.0}[n_max]
generated = n + 1
accepted = generated * 2 // 3
drafted = accepted + (generated - accepted) // 2
print(p + "encoded %4d tokens in %8.3f seconds, speed: %8.3f t/s" % (prompt_tokens, 0.25, prompt_tokens / 0.25),
      file=sys.stderr)
print(p + "decoded %4d tokens in %8.3f seconds, speed: %8.3f t/s" % (generated, generated / speed, speed),
      file=sys.stderr)
for key, value in (("n_draft  ", n_max), ("n_predict", generated), ("n_drafted", drafted), ("n_accept ", accepted)):
    print(p + "%s = %d" % (key, value), file=sys.stderr)
print(p + "accept    = %.3f%%" % (100.0 * accepted / drafted), file=sys.stderr)
'''


def test_parse_real_speculative_simple_output():
    t = parse_spec_output((DATA / "speculative_simple.txt").read_text())
    assert (t.prompt_tokens, t.generated, t.n_max, t.drafted, t.accepted) == (13, 37, 4, 27, 27)
    assert (t.decode_s, t.decode_tokens_per_s, t.encode_s) == (16.645, 2.223, 2.905)
    assert t.rounds == 10 and t.tokens_per_round == pytest.approx(3.7) and t.acceptance == 1.0
    stats, ttft = spec_stats(t)
    assert stats.tokens_per_s == pytest.approx(37 / 16.645)  # llama.cpp's own rate
    assert stats.mean_tokens_per_round == pytest.approx(3.7) and stats.acceptance_rate == 1.0
    assert ttft == pytest.approx(2.905 + 16.645 / 10)


def test_parse_real_completion_output():
    t = parse_completion_output((DATA / "completion.txt").read_text())
    assert (t.prompt_tokens, t.eval_runs, t.generated) == (13, 15, 16)
    assert t.eval_s == pytest.approx(0.4399) and t.eval_tokens_per_s == 34.10


@pytest.mark.parametrize("text", ["", "llama.cpp: error: unknown argument --spec-type\n",
                                  (DATA / "completion.txt").read_text()])
def test_unparsable_spec_output_raises(text):
    with pytest.raises(LlamaCppOutputError, match="cannot parse llama-speculative-simple output"):
        parse_spec_output(text)


def test_spec_output_missing_a_line_or_contradicting_itself_raises():
    real = (DATA / "speculative_simple.txt").read_text()
    with pytest.raises(LlamaCppOutputError, match="no n_accept line"):
        parse_spec_output(real.replace("n_accept  = 27", "accepted: 27"))
    with pytest.raises(LlamaCppOutputError, match="contradict"):
        parse_spec_output(real.replace("n_accept  = 27", "n_accept  = 40"))
    with pytest.raises(LlamaCppOutputError, match="cannot parse llama-completion output: no eval line"):
        parse_completion_output(real.split("common_perf_print:        eval time")[0])


def test_sampling_flags_match_our_samplers():
    from benchmarks.llama_cpp_spec import sampling_flags
    from spec_core.config import SamplingParams

    greedy = sampling_flags(SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert greedy == ["--temp", "0", "--top-k", "1", "--repeat-penalty", "1.0", "--ignore-eos"]
    sampled = sampling_flags(SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=8))
    assert sampled == ["--temp", "0.8", "--top-k", "0", "--top-p", "0.9", "--min-p", "0", "--repeat-penalty", "1.0",
                       "--seed", "7"]


@pytest.fixture()
def stub_build(tmp_path, monkeypatch) -> Path:
    """``$SSD_LLAMA_CPP_DIR`` with stub binaries and a build record; the stub's argv log."""
    bin_dir = tmp_path / "llama.cpp" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("llama-speculative-simple", "llama-completion"):
        exe = bin_dir / name
        exe.write_text(f"#!{sys.executable}\n{STUB}")
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    (bin_dir.parent / "build.json").write_text(json.dumps({"llama_cpp_commit": "stub", "cmake_flags": []}))
    monkeypatch.setenv("SSD_LLAMA_CPP_DIR", str(bin_dir.parent))
    monkeypatch.setenv("LLAMA_STUB_LOG", str(tmp_path / "argv.jsonl"))
    return tmp_path / "argv.jsonl"


@pytest.fixture(scope="module")
def default_gguf_pair(real_pair) -> dict[str, str]:
    """The default pair with the draft's GGUF export in the model cache (written once, as ``make draft-gguf``)."""
    from spec_core.gguf_export import export_llama_gguf, exported_path
    from spec_core.model_paths import installed_target_gguf

    if not exported_path(real_pair["draft"]).is_file():
        export_llama_gguf(real_pair["draft"], installed_target_gguf())
    return real_pair


def _bench(pair: dict[str, str], modes: tuple[str, ...]) -> dict:
    from benchmarks.bench import BenchSettings, run_bench
    from spec_core.config import ModelConfig

    settings = BenchSettings(modes, num_prompts=2, max_new_tokens=4, k=3, repeats=1, temperatures=(0.0,),
                             prompts_file=None, ignore_eos=True, target_threads=1, prompt_set="code")
    return run_bench(settings, ModelConfig(pair["target"]), ModelConfig(pair["draft"]), summary=False)


def test_llama_cpp_spec_row_schema(stub_build, default_gguf_pair):
    from benchmarks.llama_cpp_mode import has_python_package
    from spec_core.prompts import code_prompts

    report = _bench(default_gguf_pair, ("llama-cpp-spec", "llama-cpp-2t"))
    rows = {r["mode"]: r for r in report["results"]}
    row = rows["llama-cpp-spec"]
    assert row["runtime"] == "llama.cpp" and row["num_runs"] == 2 and row["num_generated"] == 2 * 5
    # every run at the stub's speed for the n-max the sweep picked (its seconds printed to 3 decimals)
    assert row["tokens_per_s_min_run"] == row["tokens_per_s_max_run"] == pytest.approx(15.0, rel=2e-3)
    assert row["acceptance_rate"] == pytest.approx(3 / 4) and row["mean_tokens_per_round"] == pytest.approx(5 / 2)
    assert row["matches_target_greedy"] is None and row["plain_round_fraction"] is None
    assert (row["dtype"], row["draft_dtype"], row["cores"], row["target_threads"]) == ("gguf", "gguf", 2, 2)
    spec = row["llama_cpp"]
    assert spec["n_max"] == 4 and list(spec["n_max_sweep"]) == [str(n) for n in N_MAX_SWEEP]
    assert (spec["p_min"], spec["threads"], spec["draft_threads"]) == (P_MIN, 2, 2)
    assert spec["build"]["llama_cpp_commit"] == "stub" and spec["draft_gguf"].endswith(".gguf")
    calls = [json.loads(line) for line in stub_build.read_text().splitlines()]
    spec_calls = [c for c in calls if c[0] == "llama-speculative-simple"]
    assert len(spec_calls) == 1 + 2 * len(N_MAX_SWEEP) + 2  # warm-up, sweep, measured runs
    last = spec_calls[-1]
    assert last[last.index("-p") + 1] == code_prompts(2)[1] and "--no-escape" in last
    assert last[last.index("-t") + 1] == last[last.index("-td") + 1] == "2"
    assert last[last.index("--spec-draft-n-max") + 1] == "4" and last[last.index("--temp") + 1] == "0"
    if not has_python_package():  # AR through the built llama-completion
        ar = rows["llama-cpp-2t"]
        assert ar["tokens_per_s_median_run"] == pytest.approx(20.0) and ar["target_threads"] == 2
        assert ar["llama_cpp"]["binary"].endswith("llama-completion")


def test_llama_cpp_spec_garbage_output_fails_the_bench(stub_build, default_gguf_pair, monkeypatch):
    monkeypatch.setenv("LLAMA_STUB_GARBAGE", "1")
    with pytest.raises(LlamaCppOutputError, match="cannot parse llama-speculative-simple output"):
        _bench(default_gguf_pair, ("llama-cpp-spec",))


def test_llama_cpp_spec_skipped_without_the_binary(tmp_path, monkeypatch, real_pair, capsys):
    from benchmarks.llama_cpp_spec import unavailable_reason

    monkeypatch.setenv("SSD_LLAMA_CPP_DIR", str(tmp_path / "nothing"))
    reason = unavailable_reason(real_pair["target"], real_pair["draft"])
    assert reason.startswith("llama-speculative-simple is not built; run `make llama-cpp`")
    report = _bench(real_pair, ("llama-cpp-spec",))
    (row,) = report["results"]
    assert row["skipped"] == reason and row["tokens_per_s"] is None
    assert f"bench: skipping llama-cpp-spec: {reason}\n" in capsys.readouterr().err
