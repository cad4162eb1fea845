"""Session 21: the adaptive planner before and after, on one drafter, modes interleaved.

    git show 5f62961:verifier_service/adaptive.py > /tmp/adaptive_old.py   # the planner before session 21
    python benchmarks/results/session21_planner_ab.py b1 w8a8 2 8            # dtype, repeats, prompts
    python benchmarks/results/session21_planner_ab.py b16 bfloat16 4 16      # T = 0.8, concurrency 16

Batch 1 (greedy): AR on the same target, then SSD with the old planner, the new one and a fixed K = 3, one
``LocalSSD`` whose engine's planner is swapped per request. Batch 16: ``benchmarks.concurrent.run_concurrent`` with
one planner per variant across passes, as ``ssd bench`` keeps one per mode.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys

import torch

from benchmarks.concurrent import run_concurrent
from cluster.local_ssd import LocalSSD, LocalSSDConfig, generate_ssd
from spec_core.chat import encode
from spec_core.config import SamplingParams, SSDConfig
from spec_core.model_paths import default_pair
from spec_core.models import LoadedPair, eos_token_ids, load_tokenizer
from spec_core.prompts import humaneval_prompts
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from verifier_service.adaptive import AdaptiveK
from verifier_service.api import engine_for_one, run_one

OLD_PATH = os.environ.get("OLD_PLANNER", "/tmp/adaptive_old.py")


def _old_planner_class():
    spec = importlib.util.spec_from_file_location("adaptive_old", OLD_PATH)
    old = importlib.util.module_from_spec(spec)
    sys.modules["adaptive_old"] = old
    spec.loader.exec_module(old)

    class Old(old.AdaptiveK):
        def observe_step(self, tokens, seconds, emitted, batch, cold_s=0.0):  # the old one has no cold_s
            return old.AdaptiveK.observe_step(self, tokens, seconds, emitted, batch)

    return Old


class Fixed(AdaptiveK):
    """K = k_max every round (``--fixed-k``), with the planner's bookkeeping kept."""

    def plan(self, accept):
        AdaptiveK.plan(self, accept)
        return dict.fromkeys(accept, self.k_max)


def _target(dtype: str) -> ModelRunner:
    path = default_pair()["target"]
    if dtype == "w8a8":
        return ModelRunner(path, dtype=torch.float32, weights="w8a8")
    return ModelRunner(path, dtype=getattr(torch, dtype))


def batch1(dtype: str, repeats: int, n: int, planners: dict[str, AdaptiveK] | None = None) -> dict:
    """AR, then SSD with each of ``planners`` (default: the old planner, the new one and a fixed K = 3)."""
    pair = default_pair()
    target = _target(dtype)
    tok = load_tokenizer(pair["target"])
    ar_engine = engine_for_one(target, None, 0)
    if planners is None:
        planners = {"old": _old_planner_class()(k_max=3), "new": AdaptiveK(k_max=3), "fixed": Fixed(k_max=3)}
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
        out[v] = {"tok_s": round(tps[v], 1), "x_ar": round(tps[v] / tps["ar"], 3),
                  "median_request_tok_s": round(statistics.median(t / s for t, s, _ in x), 1),
                  "tokens_per_round": round(sum(t for t, _, _ in x) / sum(c for _, _, c in x), 2)}
        if v in planners:
            out[v]["hit"] = round(statistics.mean(hits[v]), 3)
        if v in planners and not isinstance(planners[v], Fixed):  # (Fixed overrides the plan: not what it ran)
            p = planners[v]
            out[v].update(planned_plain_rounds=p.plain_rounds, steps=p.steps, backoffs=p.backoffs,
                          backoff_steps=p.backoff_steps)
    return {"dtype": dtype, "repeats": repeats, "prompts": n, "results": out}


def batch16(dtype: str, repeats: int, n: int) -> dict:
    pair = default_pair()
    target = _target(dtype)
    draft = ModelRunner(pair["draft"], dtype=torch.bfloat16 if dtype != "float32" else torch.float32)
    tok = load_tokenizer(pair["target"])
    loaded = LoadedPair(target, draft, tok, eos_token_ids(target, tok))
    ids = [encode(tok, p) for p in humaneval_prompts(n)]
    planners = {"ssd-old": _old_planner_class()(k_max=3), "ssd-new": AdaptiveK(k_max=3)}
    order = ["ar", *planners]
    runs = {v: [] for v in order}
    cfg = LocalSSDConfig(pair["draft"], SSDConfig(k=3), verifier_core=0, drafter_core=1)
    with LocalSSD(target, cfg, eos_ids=loaded.eos_ids) as local:
        for r in range(repeats):
            for v in order if r % 2 == 0 else order[::-1]:
                params = [SamplingParams(max_new_tokens=128, ignore_eos=True, temperature=0.8) for _ in ids]
                mode = "ar" if v == "ar" else "ssd"
                res = run_concurrent(loaded, mode, ids, params, 3, 16, local if mode == "ssd" else None,
                                     planners.get(v))
                runs[v].append({"tok_s": round(res["tokens_per_s"], 1), "held": res["backoff_step_fraction"],
                                "hit": res["cache_hit_rate"], "mean_batch_k": res["mean_batch_k"]})
    ar = statistics.median(x["tok_s"] for x in runs["ar"])
    return {"dtype": dtype, "repeats": repeats, "prompts": n, "temperature": 0.8, "concurrency": 16, "runs": runs,
            "median_x_ar": {v: round(statistics.median(x["tok_s"] for x in runs[v]) / ar, 3) for v in order}}


if __name__ == "__main__":
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    which, dt, reps, num = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps((batch1 if which == "b1" else batch16)(dt, reps, num), indent=1))
