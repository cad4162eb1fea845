"""Core lending (:mod:`verifier_service.core_lending`): plain steps of the local SSD run on the drafter's core too,
held-back prompts reach the drafter when their request first speculates, and output stays the runner's own."""

from __future__ import annotations

import os

import pytest
import torch
from outbox import Outbox
from test_adaptive import FixedCost
from test_adaptive_loop import _ScriptedK

from cluster.local_ssd import LocalSSD
from spec_core.backends.cpu import cpu_kernels
from spec_core.config import SamplingParams
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from spec_core.settings import ServiceConfig
from spec_core.speculation import PrefillEvent
from verifier_service.adaptive import AdaptiveK
from verifier_service.core_lending import CoreLending, core_lending
from verifier_service.engine import EngineConfig, VerifierEngine
from verifier_service.scheduler import SchedulerConfig
from verifier_service.ssd_proposer import SSDProposer

TWO_CORES = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


def test_a_plain_streak_lends_from_its_fifth_step() -> None:
    lend = CoreLending(0, 1)
    assert [lend.plan(p) for p in (True,) * 6 + (False,) + (True,) * 5] == [False] * 4 + [True] * 2 + [False] * 5 + [True]
    assert lend.lent_steps == 3


@pytest.mark.skipif(not TWO_CORES, reason="needs two cores")
def test_lent_runs_on_both_cores_and_puts_both_back() -> None:
    mine, threads = os.sched_getaffinity(0), torch.get_num_threads()
    a, b = sorted(mine)[:2]
    lend = CoreLending(a, b)
    with lend.lent():
        assert os.sched_getaffinity(0) == {a, b} and torch.get_num_threads() == 2
    assert os.sched_getaffinity(0) == mine and torch.get_num_threads() == threads


def test_only_a_cpu_runner_off_the_fp32_reference_with_a_drafter_on_its_own_core_lends(tiny_models) -> None:
    exact, bf16 = ModelRunner(tiny_models["llama"]), ModelRunner(tiny_models["llama"], dtype=torch.bfloat16)
    assert core_lending(0, [1], exact) is None  # its greedy output must stay transformers'
    assert core_lending(0, [1], bf16) == CoreLending(0, 1)
    assert core_lending(0, [0], bf16) is None and core_lending(0, [0, 1], bf16) is None  # a drafter not on its own
    assert core_lending(None, [1], bf16) is None and core_lending(0, [], bf16) is None


def test_a_quiet_step_holds_back_a_plain_new_requests_prompt() -> None:
    link = Outbox()
    prop = SSDProposer(link, vocab_size=50, backup_policy="fast")
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_new_tokens=8))
    (tree,) = prop.propose([seq], [0], quiet=True)
    assert tree.num_nodes == 0 and "a" not in prop.state and link.sent == []
    seq.append([9])
    prop.commit(seq, 3, tree, [], 0)  # nothing to tell: the drafter has not heard of it
    prop.propose([seq], [2])  # its first speculating round: the prompt and the tokens since, in one prefill
    (msg,) = link.sent
    assert isinstance(msg, PrefillEvent) and list(msg.token_ids) == [1, 2, 3, 9] and "a" in prop.state


def spy_threads(target: ModelRunner) -> list[int]:
    """From now on, each forward of ``target`` appends its threads times its cores (1: one core; 4: both)."""
    threads: list[int] = []
    forward = target.forward_paged

    def spy(cache, batch):
        threads.append(cpu_kernels.gemm_threads() * len(os.sched_getaffinity(0)))
        return forward(cache, batch)

    target.forward_paged = spy
    return threads


def _engine_ar(target: ModelRunner, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The runner's own AR through the engine, on one thread."""
    engine = VerifierEngine(target, EngineConfig(256, 16, SchedulerConfig(max_num_seqs=len(prompts))))
    seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    engine.run()
    return [s.output_ids for s in seqs]


@pytest.mark.skipif(not TWO_CORES, reason="the verifier and the drafter each pinned to a core of their own")
@pytest.mark.skipif(cpu_kernels.quant_gemm() is None, reason="the quantized matmuls need AVX2, FMA and F16C")
def test_lent_steps_keep_a_batch_invariant_runners_own_output(tiny_models) -> None:
    """int4 through the compiled kernels gives the same floats on one thread and two, alone and in a batch: with
    plain stretches that borrow the drafter's core, and a request that arrives during one (its prompt held back
    until it speculates), SSD's greedy output is still the runner's own AR's, token for token."""
    target = ModelRunner(tiny_models["llama"], weights="int4")
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [3, 1, 4, 1, 5]]
    refs = _engine_ar(target, prompts, 40)
    cfg = ServiceConfig(draft=str(tiny_models["llama-draft"]), k=3, budget=6, fixed_k=True, max_num_seqs=3,
                        backup="none", wait_fraction=50.0)
    with LocalSSD(target, cfg) as ssd:
        lending = ssd.engine.lending
        assert lending is not None
        ssd.engine.adaptive = _ScriptedK(k=3, plain=9, spec=3)
        threads = spy_threads(target)
        seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)]
        for s in seqs[:2]:
            ssd.engine.add(s)
        for _ in range(6):
            ssd.engine.step()
        ssd.engine.add(seqs[2])  # its first round is a lent one (step 7)
        ssd.engine.step()
        assert "2" not in ssd.proposer.state
        ssd.engine.step()
        ssd.engine.step()  # step 9 speculates: the drafter hears of request 2, all its tokens in one prefill
        assert "2" in ssd.proposer.state
        ssd.engine.run()
        ssd.engine.blocks.check_all_free()
    assert [s.output_ids for s in seqs] == refs
    assert lending.lent_steps >= 8 and set(threads) == {1, 4}


@pytest.mark.skipif(not TWO_CORES, reason="the verifier and the drafter each pinned to a core of their own")
@pytest.mark.skipif(cpu_kernels.quant_gemm() is None, reason="the quantized matmuls need AVX2, FMA and F16C")
def test_the_bench_reports_its_lent_steps(tiny_models) -> None:
    from benchmarks.concurrent import run_concurrent
    from spec_core.models import LoadedPair

    target = ModelRunner(tiny_models["llama"], weights="int4")
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 2
    cfg = ServiceConfig(draft=str(tiny_models["llama-draft"]), k=3, budget=6, fixed_k=True, max_num_seqs=2)
    with LocalSSD(target, cfg) as ssd:
        out = run_concurrent(LoadedPair(target, None, tokenizer=None, eos_ids=()), "ssd", prompts, params, 3, 2, ssd,
                             _ScriptedK(k=3, plain=9, spec=3))
    assert out["outputs"] == _engine_ar(target, prompts, 30)
    assert 0.3 < out["lent_step_fraction"] < 0.7  # 5 of every 12 steps, and the prefill


def _simulate(planner: AdaptiveK, emitted: float, steps: int = 1500, disturbed: int = 0) -> tuple[float, CoreLending]:
    """Batch 1 on a machine where a plain step takes 1.0 on one core and 0.6 on both (the first ``disturbed`` lent
    steps 2.0), and a speculating one 1.1 for ``emitted`` tokens; the engine lends as :class:`CoreLending` says.
    Returns (tokens per unit time, lending)."""
    lending, tokens, spent = CoreLending(0, 1), 0.0, 0.0
    planner.lend_after = lending.after if planner.lend_after is not None else None
    for step in range(steps):
        k = planner.plan({"r": (50, 100, step)})["r"]
        lent = planner.lend_after is not None and lending.plan(k == 0)
        lent_s = 2.0 if lending.lent_steps <= disturbed else 0.6
        s, e = (lent_s, 1.0) if lent else (1.0, 1.0) if k == 0 else (1.1, emitted)
        planner.observe_step(1 + k, s, e, 1, lent=lent)
        tokens, spent = tokens + e, spent + s
    return tokens / spent, lending


def test_the_guard_judges_speculation_against_plain_decoding_on_both_cores() -> None:
    """Speculation at 1.18x one core's plain decoding and 0.71x both cores' (sampled chat at batch 1): once a short
    hold has measured the lent steps, the guard holds the batch plain on both cores. Speculation at 2.2x one core
    (greedy) keeps speculating, with a lent measurement now and then."""
    one_core, _ = _simulate(AdaptiveK(k_max=3, cost=FixedCost(0.9, 0.1)), emitted=1.3)
    lending_planner = AdaptiveK(k_max=3, cost=FixedCost(0.9, 0.1), lend_after=4)
    both, lending = _simulate(lending_planner, emitted=1.3)
    assert lending_planner.lent_s[1] == pytest.approx(0.6) and lending_planner.plain_time(1) == pytest.approx(1.0)
    assert lending_planner.lend_probes >= 1 and lending_planner.backoffs >= 2
    assert lending.lent_steps > 1000 and both > 1.5 > 1.2 > one_core, (lending.lent_steps, both, one_core)
    greedy = AdaptiveK(k_max=3, cost=FixedCost(0.9, 0.1), lend_after=4)
    rate, lending = _simulate(greedy, emitted=2.4)
    assert greedy.lend_probes >= 1 and greedy.backoffs == 0 and lending.lent_steps < 0.02 * 1500 and rate > 2.0


@pytest.mark.parametrize("disturbed", [3, 8])
def test_slow_first_lent_steps_do_not_hide_what_lending_gains(disturbed) -> None:
    """The first lent steps (a whole lend probe's at 8) take 2.0 instead of 0.6, as when the drafter is still at
    work on its core: the guard still measures lending soon, backs off and lends nearly every step (a running
    mean of the first probe kept it judging against one core for 512 steps, lending about 900 of 1500)."""
    planner = AdaptiveK(k_max=3, cost=FixedCost(0.9, 0.1), lend_after=4)
    rate, lending = _simulate(planner, emitted=1.3, disturbed=disturbed)
    assert planner.lent_s[1] == pytest.approx(0.6) and planner.backoffs >= 1
    assert lending.lent_steps > 1250 and rate > 1.5, (lending.lent_steps, rate)


def test_the_first_lend_probe_comes_before_the_first_window() -> None:
    """With lending possible, a batch size's first steps are plain, the last of them lent: the first window of
    speculation is then judged against both cores. Without lending nothing is held."""
    planner = AdaptiveK(k_max=3, cost=FixedCost(0.9, 0.1), lend_after=4)
    lending = CoreLending(0, 1)
    ks, lent = [], []
    for step in range(12):
        k = planner.plan({"r": (0, 0, step)})["r"]
        ks.append(k)
        lent.append(lending.plan(k == 0))
        planner.observe_step(1 + k, 0.6 if lent[-1] else 1.0, 1, 1, lent=lent[-1])
    assert ks == [0] * 12 and sum(lent) == planner.lend_probe_steps and planner.lent_s[1] == pytest.approx(0.6)
    assert planner.lend_probes == 1
    alone = AdaptiveK(k_max=3, cost=FixedCost(0.9, 0.1))
    assert [alone.plan({"r": (0, 0, s)})["r"] for s in range(3)] == [3, 3, 3] and alone.lend_probes == 0


def test_the_batch_plans_against_lent_plain_steps_until_a_window_says_otherwise() -> None:
    """Acceptance 0.5 at K <= 3 pays against a plain step on one core (1.0) but not against a lent one (0.6): the
    batch plans K = 0. Once the guard's window measured speculation paying, its K is planned against one core."""
    planner = AdaptiveK(k_max=3, cost=FixedCost(0.9, 0.1), lend_after=4)
    planner.plain_s[1], planner.lent_s[1], planner.lent_at[1] = 1.0, 0.6, 0
    assert planner.plan({"r": (50, 100, 5)})["r"] == 0
    planner.backoff(1).gain = 1.2
    assert planner.plan({"r": (50, 100, 6)})["r"] > 0
    planner.lent_s[1] = 1.1  # lending measured slower than one core: not a baseline
    planner.backoff(1).gain = None
    assert planner.plan({"r": (50, 100, 7)})["r"] > 0
