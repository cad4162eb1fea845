"""Adaptive K wired into the SSD loop: greedy stays exact while K moves, plain rounds reach the drafter, and the
bench keeps one planner per mode (the planner's units: ``test_adaptive.py``)."""

from __future__ import annotations

import os

import pytest
from reference_decoding import greedy_outputs
from test_adaptive import FixedCost

from cluster.local_ssd import LocalSSD
from spec_core.config import SamplingParams
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from spec_core.settings import ServiceConfig
from verifier_service.adaptive import AdaptiveK

# the verifier and the drafter process each pinned to a core of their own
pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or os.cpu_count() < 2, reason="needs two cores")


def _run_greedy(ssd: LocalSSD, prompts: list[list[int]], n: int) -> list[Sequence]:
    """``prompts`` through the local SSD engine, ``n`` greedy tokens each; every K/V block is free afterwards."""
    seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for i, p in enumerate(prompts)]
    for s in seqs:
        ssd.engine.add(s)
    ssd.engine.run()
    ssd.engine.blocks.check_all_free()
    return seqs


def test_adaptive_k_in_the_ssd_loop_keeps_greedy_exact(tiny_models) -> None:
    target = ModelRunner(tiny_models["llama"])
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    refs = greedy_outputs(target, prompts, 24)
    cfg = ServiceConfig(draft=str(tiny_models["llama-draft"]), k=3, budget=6, ssd_strategy="fanout", max_num_seqs=2)
    with LocalSSD(target, cfg) as ssd:
        # an injected cost model under which speculation does not pay: K drops to 0 (with periodic probes)
        ssd.engine.adaptive.cost = FixedCost(0.001, 0.01)
        ssd.engine.adaptive.prior_a = 0.2
        seqs = _run_greedy(ssd, prompts, 24)
        assert [s.output_ids for s in seqs] == refs
        speculating_rounds = ssd.proposer.stats.rounds
        assert ssd.engine.metrics.num_steps - 1 > speculating_rounds  # some steps ran with K = 0


class _ScriptedK:
    """A planner that runs ``plain`` plain steps, then ``spec`` at K = ``k``, repeatedly (the engine's
    ``adaptive`` interface: plan, observe_step, batch_k; and the bench's backoff_steps)."""

    backoff_steps = 0

    def __init__(self, k: int, plain: int, spec: int) -> None:
        self.k, self.plain, self.spec, self.steps, self.batch_k = k, plain, spec, 0, 0

    def plan(self, accept):
        self.steps += 1
        self.batch_k = self.k if self.steps % (self.plain + self.spec) >= self.plain else 0
        return dict.fromkeys(accept, self.batch_k)

    def observe_step(self, *args, **kwargs) -> None:
        pass


def test_plain_rounds_reach_the_drafter_in_one_event(tiny_models) -> None:
    """Plain rounds' outcomes wait for the request's next speculating round and go as one event. With the target
    as its own draft, every just-in-time or pre-drafted token after such a gap is accepted only if the drafter's
    state matches the verifier's exactly; and the output is the target's own."""
    target = ModelRunner(tiny_models["llama"])
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    refs = greedy_outputs(target, prompts, 40)
    cfg = ServiceConfig(draft=str(tiny_models["llama"]), k=3, budget=6, ssd_strategy="fanout", fixed_k=True,
                        max_num_seqs=2, backup="none", wait_fraction=50.0)
    with LocalSSD(target, cfg) as ssd:
        ssd.engine.adaptive = _ScriptedK(k=3, plain=5, spec=3)
        seqs = _run_greedy(ssd, prompts, 40)
        assert [s.output_ids for s in seqs] == refs
        stats = ssd.proposer.stats
        assert stats.deferred_outcomes >= 10, stats.deferred_outcomes
        drafted = sum(s.stats.num_drafted for s in seqs)
        accepted = sum(s.stats.num_accepted for s in seqs)
        assert drafted >= 12 and accepted == drafted, (accepted, drafted)


def test_bench_concurrent_runs_keep_one_planner_and_restore_the_engines(tiny_models) -> None:
    """``ssd bench`` at concurrency > 1 drives the mode's one planner across its runs (as ``ssd serve`` keeps one
    for its engine's life) and puts the local SSD engine's own planner back, so later batch-1 runs stay adaptive."""
    from benchmarks.concurrent import run_concurrent
    from spec_core.models import LoadedPair

    target = ModelRunner(tiny_models["llama"])
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    refs = greedy_outputs(target, prompts, 16)
    pair = LoadedPair(target, None, tokenizer=None, eos_ids=())
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True)] * 2
    cfg = ServiceConfig(draft=str(tiny_models["llama-draft"]), k=3, budget=6, ssd_strategy="fanout", max_num_seqs=2)
    with LocalSSD(target, cfg) as ssd:
        own, planner = ssd.engine.adaptive, AdaptiveK(k_max=3)
        first = run_concurrent(pair, "ssd", prompts, params, 3, 2, ssd, planner)
        steps = planner.steps
        second = run_concurrent(pair, "ssd", prompts, params, 3, 2, ssd, planner)
        assert ssd.engine.adaptive is own and own.steps == 0
        assert steps > 0 and planner.steps > steps  # one planner, carried from the first run to the second
        assert first["outputs"] == second["outputs"] == refs
