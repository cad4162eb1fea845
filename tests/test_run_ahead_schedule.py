"""The run-ahead pair's two schedules (pipelined, alternating): the measured choice, the drafter's side of the shared
flags (it stops at K while alternating, and says when it idles), and the local pair alternating for real: its
verifies run on both cores while the drafter idles, and its greedy output stays the runner's own."""

from __future__ import annotations

import multiprocessing as mp

import pytest
from test_core_lending import TWO_CORES, _engine_ar, spy_threads

from cluster.local_ssd import LocalSSD
from drafter_service.run_ahead import RunAheadDrafter, RunAheadLoop
from spec_core.backends.cpu import cpu_kernels
from spec_core.config import SamplingParams, SSDConfig
from spec_core.core_flags import CoreFlags
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from spec_core.settings import ServiceConfig
from spec_core.speculation import OutcomeEvent, PrefillEvent
from verifier_service.run_ahead_schedule import ALTERNATING, PIPELINED, RunAheadSchedule


def _feed(s: RunAheadSchedule, rounds: int, seconds: dict[str, float], batch: int = 1) -> list[str]:
    """``rounds`` rounds, each taking what its schedule costs; returns the schedule of each."""
    seen = []
    for _ in range(rounds):
        seen.append(s.current)
        s.observe(batch, seconds[s.current])
    return seen


def test_auto_times_both_and_keeps_the_faster() -> None:
    s = RunAheadSchedule(window=4, settle=1, reprobe=40)
    seen = _feed(s, 12, {PIPELINED: 0.09, ALTERNATING: 0.07})
    # a window pipelined (after settling), then one alternating, then it stays there
    assert seen[:5] == [PIPELINED] * 5 and seen[5:10] == [ALTERNATING] * 5 and s.current == ALTERNATING
    assert s.round_s == {(PIPELINED, 1): 0.09, (ALTERNATING, 1): 0.07}
    seen = _feed(s, 60, {PIPELINED: 0.09, ALTERNATING: 0.07})
    assert seen.count(PIPELINED) == 5 and s.current == ALTERNATING  # timed again once after `reprobe`, and lost


def test_auto_follows_the_machine_when_it_changes() -> None:
    s = RunAheadSchedule(window=4, settle=0, reprobe=8)
    _feed(s, 8, {PIPELINED: 0.09, ALTERNATING: 0.07})
    assert s.current == ALTERNATING
    seen = _feed(s, 8, {PIPELINED: 0.05, ALTERNATING: 0.08})  # now pipelined is faster: found at the re-probe
    assert seen == [ALTERNATING] * 4 + [PIPELINED] * 4 and s.current == PIPELINED
    assert s.round_s == {(PIPELINED, 1): 0.05, (ALTERNATING, 1): 0.08}


def test_a_new_batch_size_is_measured_apart_and_fixed_schedules_never_switch() -> None:
    s = RunAheadSchedule(window=3, settle=0)
    _feed(s, 6, {PIPELINED: 0.09, ALTERNATING: 0.07})
    assert s.current == ALTERNATING and set(s.round_s) == {(PIPELINED, 1), (ALTERNATING, 1)}
    _feed(s, 3, {PIPELINED: 0.2, ALTERNATING: 0.1}, batch=4)
    assert (ALTERNATING, 4) in s.round_s and s.current == PIPELINED  # batch 4's other schedule is unmeasured
    for mode in (PIPELINED, ALTERNATING):
        fixed = RunAheadSchedule(mode=mode, window=2)
        assert set(_feed(fixed, 20, {PIPELINED: 0.01, ALTERNATING: 0.02})) == {mode} and not fixed.round_s
    with pytest.raises(ValueError, match="schedule"):
        RunAheadSchedule(mode="sometimes")


class _Link:
    """The drafter's end of a link, scripted: each recv returns the next event and records the idle flag."""

    def __init__(self, events: list[object], idle) -> None:
        self.events, self.idle, self.idle_seen, self.sent = list(events), idle, [], []

    def recv(self) -> object:
        self.idle_seen.append(self.idle.value)
        if not self.events:
            raise EOFError
        return self.events.pop(0)

    def poll(self, timeout: float | None = 0.0) -> bool:
        return False

    def send(self, msg: object) -> None:
        self.sent.append(msg)

    def flush(self) -> None:
        pass


def test_the_drafter_stops_at_k_while_alternating_and_idles_with_its_flag_up(tiny_models) -> None:
    draft = ModelRunner(tiny_models["llama-draft"])
    flags = CoreFlags.new()
    prefill = PrefillEvent("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=8), 3)
    for alternate, depth in ((0, 7), (1, 3)):
        flags.alternate.value = alternate
        drafter = RunAheadDrafter(draft, SSDConfig(k=3, num_blocks=64, block_size=8), alternate=flags.alternate)
        link = _Link([prefill], flags.idle)
        RunAheadLoop(drafter, link, idle=flags.idle).run()  # drafts until nothing is wanted, then EOF
        assert len(drafter.requests["r"].chain) == depth and link.idle_seen == [1, 1]  # the prefill's wait too
        assert flags.idle.value == 0
    # a round that took the whole chain (two accepted, the bonus its third) leaves the next K to draft
    tokens = drafter.requests["r"].chain
    drafter.apply(OutcomeEvent("r", 0, verified=tokens[:2], num_accepted=2, bonus=tokens[2], next_k=3))
    assert drafter.requests["r"].chain == [] and [r.seq.request_id for r in drafter.wanted()] == ["r"]
    assert drafter.requests["r"].num_computed == 6  # the K/V of the committed tokens stays
    flags.alternate.value = 0
    assert drafter.depth(drafter.requests["r"]) == 7


@pytest.mark.skipif(not TWO_CORES, reason="the verifier and the drafter each pinned to a core of their own")
@pytest.mark.skipif(cpu_kernels.quant_gemm() is None, reason="the quantized matmuls need AVX2, FMA and F16C")
def test_alternating_verifies_on_both_cores_and_keeps_the_runners_own_output(tiny_models) -> None:
    target = ModelRunner(tiny_models["llama"], weights="int4")
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    refs = _engine_ar(target, prompts, 40)
    cfg = ServiceConfig(draft=str(tiny_models["llama-draft"]), k=3, ssd_strategy="run-ahead", fixed_k=True,
                        max_num_seqs=2, run_ahead_schedule="alternating")
    with LocalSSD(target, cfg) as ssd:
        assert ssd.strategy == "run-ahead" and ssd.engine.lending is not None
        assert ssd._flags.alternate.value == 1  # before the first round
        threads = spy_threads(target)
        seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)]
        for s in seqs:
            ssd.engine.add(s)
        ssd.engine.run()
        ssd.engine.blocks.check_all_free()
        schedule, idle_steps = ssd.proposer.schedule, ssd.engine.lending.idle_steps
    assert [s.output_ids for s in seqs] == refs
    assert schedule.rounds[PIPELINED] == 0 and schedule.rounds[ALTERNATING] > 0
    assert idle_steps > 0 and 4 in threads


def test_the_flags_cross_to_a_spawned_process() -> None:
    flags = CoreFlags.new()
    proc = mp.get_context("spawn").Process(target=_raise_idle, args=(flags,))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 0 and flags.idle.value == 1 and flags.waiting.value == 0


def _raise_idle(flags: CoreFlags) -> None:
    flags.idle.value = 1
