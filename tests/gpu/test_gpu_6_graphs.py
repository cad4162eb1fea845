"""CUDA graphs over the static-buffer step (:mod:`spec_core.backends.cuda_graphs`), on the toy target: graph replay
equals eager token for token (fp32 and bf16 greedy, a batch of three requests, and a tree verify step), a context
length not seen before costs what a seen one costs, and ``ssd bench-costs --shapes`` gives its GPU rows."""

from __future__ import annotations

import json
import time

import pytest
import torch

from spec_core.backends.default import static_step
from spec_core.backends.static_step import Buckets
from spec_core.packing import WorkItem, pack
from spec_core.runner import ModelRunner

pytestmark = pytest.mark.gpu

SPAN = 512  # slots per request
NEW = 32
BUCKETS = {"max_batch": 8, "max_tokens": 8, "max_context": SPAN}


def _graph_step(runner, cache, **buckets):
    """Graphs on a CUDA cache; the same static step without capture in a CPU dry run."""
    return static_step(runner.forward_paged, cache, Buckets(**{**BUCKETS, **buckets}))


def _built(step) -> int:
    """Buckets a step has built: graphs captured (CUDA) or buffers allocated (CPU dry run)."""
    return len(step.graphs) if hasattr(step, "graphs") else len(step.buffers)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _decode_items(seqs: list[list[int]]) -> list[WorkItem]:
    """One new token per request (its last), request r in slots from ``r * SPAN``."""
    items = []
    for r, seq in enumerate(seqs):
        n, base = len(seq) - 1, r * SPAN
        items.append(WorkItem(list(range(base, base + n)), seq[-1:], [n], [base + n], 1, [], [0]))
    return items


def _greedy(runner, forward, cache, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy decode of the prompts side by side: an eager prefill, then ``new`` steps of ``forward``."""
    prefill = [WorkItem([], p, list(range(len(p))), list(range(r * SPAN, r * SPAN + len(p))), len(p), [],
                        [len(p) - 1]) for r, p in enumerate(prompts)]
    first = runner.forward_paged(cache, pack(prefill, cache.scratch_slot, runner.device))
    seqs = [p + [int(first[r, 0].argmax())] for r, p in enumerate(prompts)]
    for _ in range(new - 1):
        logits = forward(cache, pack(_decode_items(seqs), cache.scratch_slot, runner.device))
        for r, s in enumerate(seqs):
            s.append(int(logits[r, 0].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def _prompts(n: int, lengths=(20, 33, 9)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 8000, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)]


def _prefix(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(next((j for j, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(a, b))
    return f"{same}/{sum(len(u) for u in a)}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_greedy(dtype, toy_pair, device, gpu_report):
    """Three requests side by side, greedy: graph replay gives the tokens of the same static step run eagerly, in
    fp32 and bf16, and in fp32 those of the dynamic forward too (bf16's agreement with it is reported: its padded
    attention may round a near-tie the other way). Then a tree verify step beside a chain, graph against eager."""
    from spec_core.backends.static_step import StaticStep

    runner = ModelRunner(toy_pair["target"], dtype=getattr(torch, dtype), device=device)
    prompts = _prompts(3)
    caches = [runner.new_paged_cache(3 * SPAN // 16, 16) for _ in range(3)]
    step = _graph_step(runner, caches[2])
    static = StaticStep(runner.forward_paged, caches[1].scratch_slot, runner.device, Buckets(**BUCKETS))
    dynamic, eager, got = (_greedy(runner, f, c, prompts, NEW)
                           for f, c in zip((runner.forward_paged, static, step), caches))
    captures = [round(s * 1e3) for s in getattr(step, "capture_s", {}).values()]
    gpu_report(f"graphs {dtype} on {device}: {len(captures)} graph(s) captured in {captures} ms; greedy tokens "
               f"equal to the eager static step: {got == eager}, to the dynamic forward: {_prefix(got, dynamic)}")
    assert got == eager
    if dtype == "float32":
        assert got == dynamic
    tree = [WorkItem(list(range(20)), [5, 6, 7, 8], [20, 21, 21, 22], [20, 21, 22, 23], 1, [0, 0, 1], [0, 1, 2, 3]),
            WorkItem(list(range(SPAN, SPAN + 33)), [9, 10, 11], [33, 34, 35], [SPAN + 33, SPAN + 34, SPAN + 35], 3,
                     [], [0, 1, 2])]
    a, b = (f(c, pack(tree, c.scratch_slot, runner.device)) for f, c in ((static, caches[1]), (step, caches[2])))
    gpu_report(f"graphs {dtype}: tree verify step, max |graph - eager| logit {float((a - b).abs().max()):.3g}")
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.timeout(300)
def test_new_context_lengths_cost_what_seen_ones_cost(toy_pair, device, gpu_report):
    """bf16, one request: decode steps at context lengths not seen before replay their bucket's graph (no capture)
    and cost no more than steps at seen lengths; graph and eager ms per step reported."""
    runner = ModelRunner(toy_pair["target"], dtype=torch.bfloat16, device=device)
    cache = runner.new_paged_cache(SPAN // 16, 16)
    step = _graph_step(runner, cache, context_step=256)
    seq = _prompts(1, (40,))[0] + list(range(200))

    def ms_per_step(forward, lengths: range) -> float:
        batches = [pack(_decode_items([seq[: n + 1]]), cache.scratch_slot, runner.device) for n in lengths]
        _sync(device)
        t0 = time.perf_counter()
        for b in batches:
            forward(cache, b)
        _sync(device)
        return (time.perf_counter() - t0) / len(batches) * 1e3

    ms_per_step(step, range(40, 80))  # captures the bucket
    captured = _built(step)
    seen = ms_per_step(step, range(40, 80))
    fresh = ms_per_step(step, range(120, 160))
    eager = ms_per_step(runner.forward_paged, range(40, 80))
    gpu_report(f"graphs bf16 toy, batch 1: {seen:.2f} ms/step at seen lengths, {fresh:.2f} at new ones; eager "
               f"{eager:.2f} ms/step")
    assert _built(step) == captured  # no capture for a new length in a seen bucket
    assert fresh <= 1.5 * seen + 0.5, (fresh, seen)


@pytest.mark.timeout(400)
def test_bench_costs_shapes_on_the_gpu(device, gpu_report, capsys):
    """``ssd bench-costs --shapes`` on the device, bf16: the rows are reported, asserted only to be positive."""
    from ssd_cli.main import main

    cuda = torch.device(device).type == "cuda"
    shapes = "smollm2-135m,qwen2.5-coder-1.5b" if cuda else "tiny"  # a CPU dry run times the tiny shape
    assert main(["bench-costs", "--shapes", shapes, "--device", device, "--dtype", "bfloat16" if cuda else "float32",
                 "--k-max", "4", "--repeats", "50" if cuda else "3"]) == 0
    rows = json.loads(capsys.readouterr().out)["shapes"]
    for r in rows:
        e, s = r["eager"], r["static"]
        gpu_report(f"bench-costs {r['shape']} {r['dtype']} on {r['device']}: T(1) eager {e['t1_s'] * 1e3:.2f} ms, "
                   f"graphs {s['t1_s'] * 1e3:.2f} ms; V(4) eager {e['V']['4']:.2f}, graphs {s['V']['4']:.2f}; "
                   f"batch {r['batch']}: eager {e['batch_tokens_per_s']:.0f} tok/s, graphs "
                   f"{s['batch_tokens_per_s']:.0f} tok/s ({r['config_source']})")
        assert e["t1_s"] > 0 and s["t1_s"] > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engines_replay_graphs_and_keep_their_tokens(dtype, toy_pair, device, gpu_report):
    """The engines as users run them (the toy pair through :class:`verifier_service.api.Generator`): AR and SD with
    the default backend (graphs on a GPU) give the tokens of ``--enforce-eager``; ms per token of both reported."""
    from spec_core.config import ModelConfig, SamplingParams
    from verifier_service.api import Generator

    def run(graphs: bool) -> tuple[dict, dict]:
        models = [ModelConfig(toy_pair[m], dtype, device, cuda_graphs=graphs) for m in ("target", "draft")]
        gen = Generator(*models, k=3)
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        tokens, ms = {}, {}
        for mode in ("ar", "sd"):
            gen.generate("def add(a, b):", params, mode=mode)  # captures (or builds) the buckets it meets
            t0 = time.perf_counter()
            out = [gen.generate(p, params, mode=mode).token_ids for p in ("def add(a, b):", "import os\n")]
            ms[mode] = (time.perf_counter() - t0) / (2 * NEW) * 1e3
            tokens[mode] = out
        backend = gen.engine("sd", 3).backend
        assert backend.capabilities().graphs == (graphs and torch.device(device).type == "cuda")
        return tokens, ms

    graphs, eager = run(True), run(False)
    gpu_report(f"engines {dtype} on {device}, toy pair: ms/token AR {graphs[1]['ar']:.2f} with graphs, "
               f"{eager[1]['ar']:.2f} eager; SD {graphs[1]['sd']:.2f} / {eager[1]['sd']:.2f}; tokens equal: "
               f"{graphs[0] == eager[0]}")
    if dtype == "float32":
        assert graphs[0] == eager[0] and graphs[0]["ar"] == graphs[0]["sd"]  # and SD is exact against AR
