"""Core lending (:mod:`verifier_service.core_lending`): plain steps of the local SSD run on the drafter's core too,
held-back prompts reach the drafter when their request first speculates, and output stays the runner's own."""

from __future__ import annotations

import os

import pytest
import torch
from test_adaptive_loop import _ScriptedK

from cluster.local_ssd import LocalSSD, LocalSSDConfig
from spec_core import cpu_kernels
from spec_core.config import SamplingParams, SSDConfig
from spec_core.fanout import FanoutConfig
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from spec_core.speculation import PrefillEvent
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


def test_only_a_cpu_runner_off_the_fp32_reference_on_two_cores_lends(tiny_models) -> None:
    exact, bf16 = ModelRunner(tiny_models["llama"]), ModelRunner(tiny_models["llama"], dtype=torch.bfloat16)
    assert core_lending(0, 1, exact, {0, 1}) is None  # its greedy output must stay transformers'
    assert isinstance(core_lending(0, 1, bf16, {0, 1}), CoreLending)
    assert core_lending(0, 0, bf16, {0, 1}) is None and core_lending(0, 1, bf16, {0}) is None
    assert core_lending(None, 1, bf16, {0, 1}) is None


def test_a_quiet_step_holds_back_a_plain_new_requests_prompt() -> None:
    class Outbox:
        alive = True

        def __init__(self) -> None:
            self.sent = []

        def send(self, msg) -> None:
            self.sent.append(msg)

        def poll(self, timeout: float = 0.0) -> bool:
            return False

        def flush(self) -> None:
            pass

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
    cfg = LocalSSDConfig(str(tiny_models["llama-draft"]), SSDConfig(k=3, fanout=FanoutConfig(budget=6)),
                         max_num_seqs=3, backup="none", wait_fraction=50.0)
    threads: list[int] = []
    forward = target.forward_paged

    def spy(cache, batch):
        threads.append(cpu_kernels.gemm_threads() * len(os.sched_getaffinity(0)))  # 1: one core; 4: both
        return forward(cache, batch)

    with LocalSSD(target, cfg) as ssd:
        lending = ssd.engine.lending
        assert lending is not None
        ssd.engine.adaptive = _ScriptedK(k=3, plain=9, spec=3)
        target.forward_paged = spy
        seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)]
        for s in seqs[:2]:
            ssd.engine.add(s)
        for _ in range(6):
            ssd.engine.step()
        ssd.engine.add(seqs[2])  # its first round is a lent one
        ssd.engine.step()
        assert "2" not in ssd.proposer.state
        ssd.engine.run()
        ssd.engine.blocks.check_all_free()
    assert [s.output_ids for s in seqs] == refs
    assert lending.lent_steps >= 8 and set(threads) == {1, 4}
    assert seqs[2].stats.num_drafted > 0  # the held-back request speculated once its prompt went over
