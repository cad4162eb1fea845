"""Session 23: the target's forward over one request by the number of tokens in the step (a chain of m nodes after
the root), bf16, one pinned thread, context 256: where the verify stops being flat (#15).

    python benchmarks/results/session23_verify_steps.py 30        # repeats per size (interleaved); medians in ms
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from spec_core.model_paths import default_pair
from spec_core.packing import WorkItem, forward_items
from spec_core.runner import ModelRunner


def main(repeats: int) -> dict[int, float]:
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    runner = ModelRunner(default_pair()["target"], dtype=torch.bfloat16)
    cache = runner.new_paged_cache(64, 16)
    n = 256
    ids = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    times: dict[int, list[float]] = {m + 1: [] for m in range(12)}
    with torch.inference_mode():
        forward_items(runner, cache, [WorkItem([], ids, list(range(n)), list(range(n)), n, [], [n - 1])])
        for _ in range(repeats):
            for tokens in times:
                m = tokens - 1
                item = WorkItem(list(range(n - 1)), [ids[-1]] + [5] * m, list(range(n - 1, n + m)),
                                list(range(n - 1, n + m)), 1, list(range(-1, m - 1)), list(range(tokens)))
                t0 = time.perf_counter()
                forward_items(runner, cache, [item])
                times[tokens].append(time.perf_counter() - t0)
    return {t: round(sorted(v)[len(v) // 2] * 1e3, 2) for t, v in times.items()}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 30), indent=1))
