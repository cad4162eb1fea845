"""Forward-pass costs of a target/draft pair on the project's runner (``ssd bench-costs``).

Reports T(1) of each model (one new token at a given context), c = T_draft(1) / T_target(1), and
V(K) = T_target(K+1) / T_target(1), timed as medians of repeated calls on the current thread setting.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from spec_core.runner import ModelRunner


def time_forward(runner: ModelRunner, context: int, new_tokens: int, repeats: int = 200) -> float:
    """Median seconds of one forward over ``new_tokens`` tokens after ``context`` cached tokens."""
    cache = runner.new_cache(1, context + new_tokens + 1)
    runner.forward(cache, torch.randint(0, runner.vocab_size, (1, context)), torch.arange(context)[None])
    ids = torch.randint(0, runner.vocab_size, (1, new_tokens))
    pos = torch.arange(context, context + new_tokens)[None]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(cache, ids, pos)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _spin_draft(draft_path: str, core: int, context: int, stop) -> None:
    """Keep another core busy the way the SSD drafter does: draft forwards, back to back."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    draft = ModelRunner(draft_path)
    cache = draft.new_cache(1, context + 2)
    draft.forward(cache, torch.randint(0, draft.vocab_size, (1, context)), torch.arange(context)[None])
    ids, pos = torch.randint(0, draft.vocab_size, (1, 1)), torch.tensor([[context]])
    while not stop.is_set():
        draft.forward(cache, ids, pos)


def target_t1_with_other_core_busy(target: ModelRunner, draft_path: str, context: int, other_core: int,
                                   repeats: int) -> float:
    """T_target(1) while the draft model runs non-stop on ``other_core`` (shared caches and memory bandwidth)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    proc = ctx.Process(target=_spin_draft, args=(draft_path, other_core, context, stop), daemon=True)
    proc.start()
    try:
        time.sleep(3.0)  # let it load and start spinning
        return time_forward(target, context, 1, repeats)
    finally:
        stop.set()
        proc.join(10)


def measure_costs(target_path: str, draft_path: str, context: int = 256, k_max: int = 8, core: int | None = 0,
                  repeats: int = 200) -> dict:
    """Pin to ``core`` with one torch thread, then time both models."""
    old_affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    old_threads = torch.get_num_threads()
    try:
        if core is not None and old_affinity is not None:
            os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
        target, draft = ModelRunner(target_path), ModelRunner(draft_path)
        t1 = time_forward(target, context, 1, repeats)
        d1 = time_forward(draft, context, 1, repeats)
        v = {k: time_forward(target, context, k + 1, max(20, repeats // 4)) / t1 for k in range(1, k_max + 1)}
        busy = None
        if core is not None and (os.cpu_count() or 1) > 1:
            busy = target_t1_with_other_core_busy(target, draft_path, context, 1 if core == 0 else 0, repeats)
    finally:
        if old_affinity is not None:
            os.sched_setaffinity(0, old_affinity)
        torch.set_num_threads(old_threads)
    return {"context": context, "target_t1_s": t1, "target_t1_other_core_busy_s": busy, "draft_t1_s": d1,
            "c": d1 / t1, "target_over_draft": t1 / d1, "V": v}
