"""Local two-process SSD: greedy output equals AR in every regime; the drafter really runs concurrently."""

from __future__ import annotations

import os

import pytest
import torch
from reference_decoding import generate_ar

from cluster.local_ssd import LocalSSD, LocalSSDConfig
from spec_core.config import SamplingParams, SSDConfig
from spec_core.fanout import FanoutConfig
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or os.cpu_count() < 2,
                                reason="needs two cores and CPU affinity")


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, 256, (4 + 3 * i,), generator=gen).tolist() for i in range(n)]


def _reference(target: ModelRunner, prompts, n_new: int) -> list[list[int]]:
    out = []
    for p in prompts:
        seq = Sequence("ref", p, SamplingParams(max_new_tokens=n_new, ignore_eos=True))
        generate_ar(target, seq)
        out.append(seq.output_ids)
    return out


def _run(target, cfg: LocalSSDConfig, prompts, n_new: int):
    with LocalSSD(target, cfg) as ssd:
        seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=n_new, ignore_eos=True))
                for i, p in enumerate(prompts)]
        for s in seqs:
            ssd.engine.add(s)
        ssd.engine.run()
        ssd.engine.blocks.check_all_free()
        info = dict(ssd.drafter_info, verifier_affinity=sorted(os.sched_getaffinity(0)))
        return [s.output_ids for s in seqs], ssd.proposer.stats, info, ssd.engine


REGIMES = {
    # the target as its own drafter with a slow verifier: (nearly) every round hits
    "all_hits": dict(draft="llama", verify_delay_s=0.15),
    # a drafter that drops its cache: every round misses and is drafted just in time
    "forced_miss": dict(draft="llama-draft", verify_delay_s=0.05, drop_cache=True),
    # a drafter far too slow: the verifier falls back to the n-gram backup
    "ngram_backup": dict(draft="llama-draft", tree_delay_s=0.5, wait_fraction=0.05, backup="ngram"),
    # ... or to no speculation at all (K = 0)
    "no_backup": dict(draft="llama-draft", tree_delay_s=0.5, wait_fraction=0.05, backup="none"),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_equals_ar_in_every_regime(tiny_models, regime):
    opts = dict(REGIMES[regime])
    draft = opts.pop("draft")
    drop = opts.pop("drop_cache", False)
    target = ModelRunner(tiny_models["llama"])
    prompts = _prompts(4)
    ssd_cfg = SSDConfig(k=4, fanout=FanoutConfig(budget=8), drop_cache=drop)
    outs, stats, _, _ = _run(target, LocalSSDConfig(str(tiny_models[draft]), ssd_cfg, max_num_seqs=4, **opts),
                             prompts, 24)
    assert outs == _reference(target, prompts, 24)
    if regime == "all_hits":
        assert stats.cache_hit_rate >= 0.6, stats
    if regime == "forced_miss":
        assert stats.hits == 0 and stats.jit > 0, stats
    if regime == "ngram_backup":
        assert stats.hits == 0 and stats.backup > 0, stats


def test_concurrency_is_real(tiny_models):
    """200 ms per verify and 140 ms per drafter tree: overlapped rounds stay under 260 ms (serial ≥ 340 ms)."""
    target = ModelRunner(tiny_models["llama"])
    cfg = LocalSSDConfig(str(tiny_models["llama"]), SSDConfig(k=3, fanout=FanoutConfig(budget=6)), max_num_seqs=1,
                         verify_delay_s=0.2, tree_delay_s=0.14, wait_fraction=1.0)
    prompts = _prompts(1)
    outs, stats, info, engine = _run(target, cfg, prompts, 16)
    assert outs == _reference(target, prompts, 16)
    assert info["affinity"] and info["verifier_affinity"]
    assert set(info["affinity"]).isdisjoint(info["verifier_affinity"]), info
    assert info["pid"] != os.getpid()
    rounds = engine.metrics.num_steps - 1
    mean_round = engine.metrics.step_s / engine.metrics.num_steps
    assert stats.hits >= rounds // 2, stats
    assert mean_round < 0.26, mean_round


def test_prefill_and_free_in_one_batch_leaks_nothing(tiny_models):
    """A request cancelled before its first bundle was built (both events in one batch) gets no KV blocks."""
    from drafter_service.process import DrafterLoop
    from drafter_service.ssd_drafter import SSDDrafter
    from spec_core.config import SSDConfig
    from spec_core.speculation import FreeEvent, PrefillEvent

    class Sink:
        def __init__(self):
            self.sent = []

        def send(self, msg):
            self.sent.append(msg)

    drafter = SSDDrafter(ModelRunner(tiny_models["llama-draft"]), SSDConfig(k=3, fanout=FanoutConfig(budget=4)))
    loop = DrafterLoop(drafter, Sink())
    params = SamplingParams(max_new_tokens=8)
    loop.handle([PrefillEvent("a", [1, 2, 3], params, 3), PrefillEvent("b", [4, 5], params, 3), FreeEvent("a")])
    assert set(drafter.requests) == {"b"} and [m.request_id for m in loop.link.sent] == ["b"]
    loop.handle([FreeEvent("b")])
    drafter.blocks.check_all_free()


def test_drafter_out_of_blocks_degrades_and_leaks_nothing(tiny_models):
    """A pool far too small for 8 long requests: the drafter builds what fits (some bundles trunk-only or empty)
    and never raises; every block comes back."""
    from drafter_service.process import DrafterLoop
    from drafter_service.ssd_drafter import SSDDrafter
    from spec_core.config import SSDConfig
    from spec_core.speculation import FreeEvent, OutcomeEvent, PrefillEvent

    class Sink:
        def __init__(self):
            self.sent = []

        def send(self, msg):
            self.sent.append(msg)

    drafter = SSDDrafter(ModelRunner(tiny_models["llama-draft"]),
                         SSDConfig(k=3, fanout=FanoutConfig(budget=4), num_blocks=12, block_size=16))
    loop = DrafterLoop(drafter, Sink())
    params = SamplingParams(max_new_tokens=8)
    prompts = _prompts(8)
    loop.handle([PrefillEvent(str(i), p * 4, params, 3) for i, p in enumerate(prompts)])
    bundles = loop.link.sent
    assert len(bundles) == 8 and drafter.out_of_blocks > 0
    assert any(b.entries for b in bundles) and any(not b.entries for b in bundles)
    # a miss answered just in time with the pool still full: an empty draft, not a crash
    full = [b for b in bundles if not b.entries][0]
    req = drafter.requests[full.request_id]
    loop.handle([OutcomeEvent(full.request_id, 0, [], 0, 7, next_k=3, verify_s=10.0, jit=True)])
    assert req.round == 1
    loop.handle([FreeEvent(str(i)) for i in range(8)])
    drafter.blocks.check_all_free()


def test_tiny_drafter_pool_under_long_requests_equals_ar(tiny_models):
    """End to end (two processes): 8 long requests through a drafter pool of 12 blocks. The drafter process
    survives and keeps speculating, the output equals AR, and the verifier's pool is whole at the end."""
    target = ModelRunner(tiny_models["llama"])
    prompts = [p * 5 for p in _prompts(8)]
    cfg = LocalSSDConfig(str(tiny_models["llama-draft"]), SSDConfig(k=3, fanout=FanoutConfig(budget=4),
                                                                    num_blocks=12, block_size=16),
                         max_num_seqs=8, wait_fraction=1.0)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with LocalSSD(target, cfg) as local:
        seqs = [Sequence(str(i), p, params) for i, p in enumerate(prompts)]
        for s in seqs:
            local.engine.add(s)
        local.engine.run()
        local.engine.blocks.check_all_free()
        alive, stats = local.proc.is_alive(), local.proposer.stats
    assert [s.output_ids for s in seqs] == _reference(target, prompts, 12)
    assert alive  # before the fix, the drafter process died of NoFreeBlocks and the backup served the rest
    assert stats.hits + stats.jit > 0, stats


def test_local_drafter_killed_mid_stream_recovers(tiny_models):
    """Kill the drafter process mid-generation: the request completes equal to AR on the backup, the watcher
    starts a new drafter process, and the next request speculates from it again."""
    import time

    target = ModelRunner(tiny_models["llama"])
    prompts = _prompts(2)
    ref = _reference(target, prompts, 48)
    cfg = LocalSSDConfig(str(tiny_models["llama"]), SSDConfig(k=3, fanout=FanoutConfig(budget=6)), max_num_seqs=1,
                         verify_delay_s=0.02, wait_fraction=1.0, restart_interval_s=0.2)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    with LocalSSD(target, cfg) as local:
        first_pid = local.proc.pid
        seq = Sequence("a", prompts[0], params)
        local.engine.add(seq)
        for _ in range(4):
            local.engine.step()
        local.proc.kill()
        local.engine.run()
        assert seq.output_ids == ref[0]
        assert local.proposer.stats.backup > 0
        deadline = time.monotonic() + 120
        while local.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert local.restarts == 1 and local.proc.pid != first_pid and local.link.alive
        hits_before = local.proposer.stats.hits
        again = Sequence("b", prompts[1], params)
        local.engine.add(again)
        local.engine.run()
        assert again.output_ids == ref[1]
        assert local.proposer.reconnects == 1 and local.proposer.stats.hits > hits_before
        local.engine.blocks.check_all_free()
