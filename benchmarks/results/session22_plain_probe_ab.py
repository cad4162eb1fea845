"""Session 22: how often the adaptive planner's periodic plain step (``probe_plain_every``) should run, at batch 1.

    python benchmarks/results/session22_plain_probe_ab.py bfloat16 2 8      # dtype, repeats, prompts

AR on the same target, then SSD with ``probe_plain_every`` = 16 (before), 48 and 64, and a fixed K = 3, on one
``LocalSSD`` whose engine's planner is swapped per request; variants interleaved prompt by prompt, 128 greedy tokens
on HumanEval (session 21's harness, :func:`benchmarks.results.session21_planner_ab.batch1`).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from benchmarks.results.session21_planner_ab import Fixed, batch1
from verifier_service.adaptive import AdaptiveK

if __name__ == "__main__":
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    planners = {f"p{p}": AdaptiveK(k_max=3, probe_plain_every=p) for p in (16, 48, 64)}
    planners["fixed"] = Fixed(k_max=3)
    print(json.dumps(batch1(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), planners), indent=1))
