"""Session 22: how often the adaptive planner's periodic plain step (``probe_plain_every``) should run, at batch 1.

    python benchmarks/results/session22_plain_probe_ab.py bfloat16 2 8      # dtype, repeats, prompts

AR on the same target, then SSD with ``probe_plain_every`` = 16 (before), 48 and 64, and a fixed K = 3, on one
``LocalSSD`` whose engine's planner is swapped per request; variants interleaved prompt by prompt, 128 greedy tokens
on HumanEval.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from cluster.local_ssd import LocalSSD, LocalSSDConfig, generate_ssd
from spec_core.chat import encode
from spec_core.config import SamplingParams, SSDConfig
from spec_core.model_paths import default_pair
from spec_core.models import load_tokenizer
from spec_core.prompts import humaneval_prompts
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from verifier_service.adaptive import AdaptiveK
from verifier_service.api import engine_for_one, run_one


class Fixed(AdaptiveK):
    """K = k_max every round (``--fixed-k``), with the planner's bookkeeping kept."""

    def plan(self, accept):
        AdaptiveK.plan(self, accept)
        return dict.fromkeys(accept, self.k_max)


def main(dtype: str, repeats: int, n: int) -> dict:
    pair = default_pair()
    path = pair["target"]
    target = (ModelRunner(path, dtype=torch.float32, weights="w8a8") if dtype == "w8a8"
              else ModelRunner(path, dtype=getattr(torch, dtype)))
    tok = load_tokenizer(path)
    ar_engine = engine_for_one(target, None, 0)
    planners = {f"p{p}": AdaptiveK(k_max=3, probe_plain_every=p) for p in (16, 48, 64)}
    planners["fixed"] = Fixed(k_max=3)
    variants = ["ar", *planners]
    runs = {v: [] for v in variants}
    hits = {v: [] for v in planners}
    prompts = [encode(tok, p) for p in humaneval_prompts(n)]
    cfg = LocalSSDConfig(pair["draft"], SSDConfig(k=3), verifier_core=0, drafter_core=1)
    with LocalSSD(target, cfg) as local:
        for r in range(repeats):
            for i, ids in enumerate(prompts):
                for v in variants if (r + i) % 2 == 0 else variants[::-1]:
                    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
                    if v == "ar":
                        seq = Sequence(f"ar{r}-{i}", list(ids), params, max_len=target.spec.max_positions)
                        stats = run_one(ar_engine, seq)
                    else:
                        local.engine.adaptive = planners[v]
                        _, stats, ssd = generate_ssd(local, ids, params, request_id=f"{v}{r}-{i}")
                        hits[v].append(ssd["cache_hit_rate"] or 0.0)
                    runs[v].append((stats.num_generated - 1, stats.decode_s, stats.num_rounds))
    tps = {v: sum(t for t, _, _ in x) / sum(s for _, s, _ in x) for v, x in runs.items()}
    out = {}
    for v, x in runs.items():
        per = [t / s for t, s, _ in x]
        out[v] = {"tok_s": round(tps[v], 1), "x_ar": round(tps[v] / tps["ar"], 3),
                  "median_request_tok_s": round(statistics.median(per), 1),
                  "tokens_per_round": round(sum(t for t, _, _ in x) / sum(c for _, _, c in x), 2)}
        if v in planners:
            out[v]["hit"] = round(statistics.mean(hits[v]), 3)
            p = planners[v]
            out[v].update(planned_plain_rounds=p.plain_rounds, steps=p.steps, backoffs=p.backoffs)
    return {"dtype": dtype, "repeats": repeats, "prompts": n, "results": out}


if __name__ == "__main__":
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])), indent=1))
