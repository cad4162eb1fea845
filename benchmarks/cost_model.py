"""Forward-pass costs of a target/draft pair on the project's runner (``ssd bench-costs``).

For one dtype, device and thread count (a *row*), it reports:
- T(1) of each model (one new token after ``context`` cached tokens) and c = T_draft(1) / T_target(1);
- V(K) = T_target(K+1) / T_target(1);
- the target's weight matmuls alone for one token (``target_matmul_t1_s``: the same products, no attention,
  norms or glue, at the rows T(1) runs as, ``target_t1_rows``, see :mod:`spec_core.backends.cpu.row_padding`; and at one
  row, ``target_matmul_one_row_s``), so T(1) / matmuls says how much of a step is overhead;
- the memory floor: the bytes of weights one token reads / the measured memory read bandwidth of the same threads
  (``floor_t1_s``), the time below which no runner can go.

Times are medians of repeated calls. On CUDA every timed call is synchronised.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from spec_core.backends.cpu.row_padding import stack_seconds
from spec_core.runner import ModelRunner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_forward(runner: ModelRunner, context: int, new_tokens: int, repeats: int = 200) -> float:
    """Median seconds of one engine forward (packing, upload, paged forward) over ``new_tokens`` tokens after
    ``context`` cached tokens: the verifier engine's own path (:func:`spec_core.packing.forward_items`)."""
    from spec_core.packing import WorkItem, forward_items

    dev = runner.device
    block = 16
    cache = runner.new_paged_cache(-(-(context + new_tokens + 1) // block), block)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.vocab_size, (context,), generator=gen).tolist()
    forward_items(runner, cache, [WorkItem([], prompt, list(range(context)), list(range(context)), context, [],
                                           [context - 1])])
    new = torch.randint(0, runner.vocab_size, (new_tokens,), generator=gen).tolist()
    span = list(range(context, context + new_tokens))
    item = WorkItem(list(range(context)), new, span, span, new_tokens, [], list(range(new_tokens)))
    return median_time(lambda: forward_items(runner, cache, [item]), dev, repeats)


@torch.inference_mode()
def time_matmuls(runner: ModelRunner, rows: int = 1, repeats: int = 200) -> float:
    """Median seconds of the runner's weight matmuls alone, for ``rows`` tokens, in its dtype and layout."""
    return stack_seconds(runner.weight_matrices(), runner.dtype, runner.device, [rows], repeats)[rows]


@torch.inference_mode()
def read_bandwidth(device: torch.device, nbytes: int = 512 << 20, repeats: int = 7) -> float:
    """Memory read bandwidth (bytes/s) of the current threads: a sum over a buffer far larger than the caches."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / median_time(lambda: buf.sum(), device, repeats)


#: How long the busy-core draft may take to load.
READY_TIMEOUT_S = 120.0


def _spin_draft(draft_path: str, core: int, context: int, dtype: str, stop, ready) -> None:
    """Keep another core busy the way the SSD drafter does: draft forwards, back to back (``ready`` is set once
    they run)."""
    from spec_core.config import ModelConfig
    from spec_core.models import load_runner

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    draft = load_runner(ModelConfig(draft_path, dtype), reference=False)
    cache = draft.new_cache(1, context + 2)
    draft.forward(cache, torch.randint(0, draft.vocab_size, (1, context)), torch.arange(context)[None])
    ids, pos = torch.randint(0, draft.vocab_size, (1, 1)), torch.tensor([[context]])
    draft.forward(cache, ids, pos)
    ready.set()
    while not stop.is_set():
        draft.forward(cache, ids, pos)


def target_t1_with_other_core_busy(target: ModelRunner, draft_path: str, context: int, other_core: int,
                                   repeats: int, dtype: str = "float32") -> float:
    """T_target(1) while the draft model runs non-stop on ``other_core`` (shared caches and memory bandwidth)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_spin_draft, args=(draft_path, other_core, context, dtype, stop, ready), daemon=True)
    proc.start()
    try:
        # Time only once it spins: a fixed 3 s wait timed the draft's loading instead (imports and file reads on the
        # other core), which reported 2-3x slowdowns that steady drafting does not cause.
        if not ready.wait(READY_TIMEOUT_S):
            raise RuntimeError(f"the draft on core {other_core} did not start within {READY_TIMEOUT_S} s")
        return time_forward(target, context, 1, repeats)
    finally:
        stop.set()
        proc.join(10)


@contextmanager
def pinned(cores: set[int] | None, threads: int):
    """Run the block on ``cores`` (CPU affinity; ``None`` leaves it) with ``threads`` torch threads."""
    old_affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    old_threads = torch.get_num_threads()
    try:
        if cores is not None and old_affinity is not None:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
        yield
    finally:
        if old_affinity is not None:
            os.sched_setaffinity(0, old_affinity)
        torch.set_num_threads(old_threads)


def measure_costs(target_path: str, draft_path: str, context: int = 256, k_max: int = 8, core: int | None = 0,
                  repeats: int = 200, dtype: str = "float32", device: str = "cpu", threads: int = 1,
                  pad_rows: bool = True, cpu_kernels: bool = True, busy_core: bool = True) -> dict:
    """One row: pin to ``threads`` cores from ``core`` (CPU only), load both models in ``dtype`` on ``device``,
    then time them. ``dtype`` may be ``auto`` (resolved for the device, and reported resolved). ``busy_core``:
    also T(1) with the draft running on the other core (one pinned thread, CPU, two cores or more)."""
    from spec_core.config import ModelConfig, draft_dtype, resolve_dtype
    from spec_core.models import load_runner

    name = resolve_dtype(dtype, device, target_path, cpu_kernels)
    draft_name = resolve_dtype(draft_dtype(name, cpu_kernels, draft_path), device)  # as every command loads it
    on_cpu = torch.device(device).type == "cpu"
    ncpu = os.cpu_count() or 1
    cores = {(core + i) % ncpu for i in range(threads)} if core is not None and on_cpu else None
    with pinned(cores, threads):
        # as every command loads them (weight formats included: a w8a8 draft is not an fp32 one)
        target = load_runner(ModelConfig(target_path, name, device, pad_rows, cpu_kernels))
        draft = load_runner(ModelConfig(draft_path, draft_name, device, pad_rows, cpu_kernels), reference=False)
        t1 = time_forward(target, context, 1, repeats)
        d1 = time_forward(draft, context, 1, repeats)
        # T(1)'s own matmuls: at the row count its forward runs as (spec_core.backends.cpu.row_padding), and at one row
        pad = target.row_padding()
        rows = pad.tokens(1, 1) if pad is not None else 1
        matmul = time_matmuls(target, rows, repeats)
        matmul_one = matmul if rows == 1 else time_matmuls(target, 1, repeats)
        v = {k: time_forward(target, context, k + 1, max(5, repeats // 4)) / t1 for k in range(1, k_max + 1)}
        bandwidth = read_bandwidth(target.device)
        busy = None
        if busy_core and on_cpu and core is not None and threads == 1 and ncpu > 1:
            busy = target_t1_with_other_core_busy(target, draft_path, context, 1 if core == 0 else 0, repeats,
                                                  draft_name)
    weight_bytes = target.weight_bytes_per_token()
    return {"dtype": name, "device": str(target.device), "threads": threads, "context": context,
            "target_t1_s": t1, "target_matmul_t1_s": matmul, "t1_over_matmul": t1 / matmul,
            "target_t1_rows": rows, "target_matmul_one_row_s": matmul_one, "cpu_kernels": target.kernels is not None,
            "floor_t1_s": weight_bytes / bandwidth, "weight_bytes_per_token": weight_bytes,
            "read_bandwidth_gbs": bandwidth / 1e9, "target_t1_other_core_busy_s": busy, "draft_t1_s": d1,
            "draft_dtype": draft_name, "draft_weights": draft.weights,
            "c": d1 / t1, "target_over_draft": t1 / d1, "V": v}
