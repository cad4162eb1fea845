"""Bench at concurrency > 1: all prompts through the continuous-batching engine, ``concurrency`` in flight.

Throughput is aggregate: Σ generated tokens ÷ wall time from the first request's admission to the last finish.
Latencies are per request: time to first token from the start of the run (so queueing counts), inter-token
gaps within each request. ``ar``, ``sd`` and ``ssd`` share one engine implementation; the hf modes run batch 1
only (stated in the results as ``batching``).
"""

from __future__ import annotations

import time

from benchmarks.modes import LOCAL_SSD_MODES
from spec_core.config import SamplingParams
from spec_core.models import LoadedPair
from spec_core.sequence import Sequence
from verifier_service.adaptive import AdaptiveK
from verifier_service.engine import VerifierEngine
from verifier_service.engine_builder import EnginePlan, build_engine
from verifier_service.scheduler import SchedulerConfig


def _engine(pair: LoadedPair, mode: str, k: int, concurrency: int, local_ssd=None) -> VerifierEngine:
    if mode in LOCAL_SSD_MODES:
        engine = local_ssd.engine
        nodes = max(k, local_ssd.ssd.max_nodes)  # the drafter's largest candidate tree
        engine.scheduler.config = SchedulerConfig(max_num_seqs=concurrency, max_spec_nodes=nodes)
        return engine
    drafter = None
    if mode == "sd":
        from spec_core.draft_engine import BatchDrafter, DraftConfig

        drafter = BatchDrafter(pair.draft, DraftConfig(k=k, num_blocks=4096))
    return build_engine(pair.target, EnginePlan(4096, 16, concurrency, k=k), drafter)


def run_concurrent(pair: LoadedPair, mode: str, prompts: list[list[int]], params: list[SamplingParams], k: int,
                   concurrency: int, local_ssd=None, planner: AdaptiveK | None = None) -> dict:
    """``planner``: sd/ssd choose K per step from measured costs (down to 0), as the service does. The caller keeps
    one planner per mode across runs, as ``ssd serve`` keeps one for its engine's life, so the back-off learned in
    one pass carries to the next; the engine's own planner is put back afterwards."""
    engine = _engine(pair, mode, k, concurrency, local_ssd)
    own, engine.adaptive = engine.adaptive, (planner if mode != "ar" else None)
    held_before = planner.backoff_steps if planner is not None else 0
    lent_before = engine.lending.lent_steps if engine.lending is not None else 0
    ks: list[int] = []
    seqs = [Sequence(f"c{i}", ids, p, eos_ids=pair.eos_ids, max_len=pair.target.spec.max_positions)
            for i, (ids, p) in enumerate(zip(prompts, params))]
    before = _ssd_counters(local_ssd) if mode in LOCAL_SSD_MODES else None
    before_stats = engine.metrics.stats.copy()
    t0 = time.perf_counter()
    for s in seqs:
        engine.add(s)
    while engine.has_work():
        engine.step()
        if engine.adaptive is not None:
            ks.append(engine.adaptive.batch_k)
    wall = time.perf_counter() - t0
    planner, engine.adaptive = engine.adaptive, own
    m = engine.metrics.stats.since(before_stats)
    total = sum(len(s.output_ids) for s in seqs)
    out = {
        "tokens_per_s": total / wall,
        "ttfts": [s.emit_times[0] - t0 for s in seqs if s.emit_times],
        "itls": [b - a for s in seqs for a, b in zip(s.emit_times, s.emit_times[1:])],
        "outputs": [list(s.output_ids) for s in seqs],
        "mean_tokens_per_round": m.mean_tokens_per_round,
        "acceptance_rate": m.acceptance_rate,
        "num_generated": total,
        "cache_hit_rate": None,
        "mean_batch_k": sum(ks) / len(ks) if ks else None,
        # steps the measured back-off held the batch at plain decoding (speculation measured slower than plain)
        "backoff_step_fraction": (planner.backoff_steps - held_before) / len(ks) if planner is not None and ks
        else None,
        # steps that ran on the drafter's core too, every request plain (verifier_service.core_lending)
        "lent_step_fraction": (engine.lending.lent_steps - lent_before) / len(ks) if engine.lending is not None and ks
        else None,
    }
    if before is not None:
        after = _ssd_counters(local_ssd)
        r, bundles = after[0] - before[0], after[2] - before[2]
        out["cache_hit_rate"] = (after[1] - before[1]) / r if r else None
        out["branches_per_bundle"] = (after[3] - before[3]) / bundles if bundles else None
    return out


def _ssd_counters(local_ssd) -> tuple[int, int, int, int]:
    s = local_ssd.proposer.stats
    return s.rounds, s.hits, s.bundles_received, s.branches_received
