"""Session 24: the target's row padding (:mod:`spec_core.row_padding`) on and off, AR and SSD, at batch 1.

    python benchmarks/results/session24_row_padding_ab.py bfloat16 2 8      # dtype, repeats, prompts

One target runner whose ``pad_rows`` is switched per request (its padding measured once, at 1 thread), one ``LocalSSD`` (its
drafter pads its own forwards throughout) with a planner per SSD variant, since the planner learns the step's
costs; variants interleaved prompt by prompt (the order reversed every other one), 128 greedy tokens on HumanEval.
Also times the target's forward alone at 1-4 tokens (context 300), both ways, interleaved.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from benchmarks.results.session21_planner_ab import _target
from cluster.local_ssd import LocalSSD, LocalSSDConfig, generate_ssd
from spec_core.chat import encode
from spec_core.config import SamplingParams, SSDConfig
from spec_core.model_paths import default_pair
from spec_core.models import load_tokenizer
from spec_core.packing import WorkItem, forward_items
from spec_core.prompts import humaneval_prompts
from spec_core.sequence import Sequence
from verifier_service.adaptive import AdaptiveK
from verifier_service.api import engine_for_one, run_one


def forward_ms(target, repeats: int = 25, context: int = 300) -> dict[str, float]:
    """Median ms of the target's forward over m = 1..4 new tokens (a chain), padded and not, interleaved."""
    cache = target.new_paged_cache(64, 16)
    ids = torch.randint(0, 1000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    forward_items(target, cache, [WorkItem([], ids, list(range(context)), list(range(context)), context, [],
                                           [context - 1])])
    times: dict[str, list[float]] = {f"{m}{tag}": [] for m in (1, 2, 3, 4) for tag in ("", "-pad")}
    span = context - 1
    for _ in range(repeats):
        for key in times:
            m = int(key[0])
            target.pad_rows = key.endswith("pad")
            item = WorkItem(list(range(span)), [ids[-1]] + [5] * (m - 1), list(range(span, span + m)),
                            list(range(span, span + m)), 1, list(range(-1, m - 2)), list(range(m)))
            t0 = time.perf_counter()
            forward_items(target, cache, [item])
            times[key].append(time.perf_counter() - t0)
    target.pad_rows = True
    return {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}


def main(dtype: str, repeats: int, n: int) -> dict:
    pair = default_pair()
    target = _target(dtype)
    pad = target.row_padding()
    tok = load_tokenizer(pair["target"])
    ar_engine = engine_for_one(target, None, 0)
    variants = ["ar", "ar-pad", "ssd", "ssd-pad"]
    planners = {"ssd": AdaptiveK(k_max=3), "ssd-pad": AdaptiveK(k_max=3)}
    runs: dict[str, list] = {v: [] for v in variants}
    prompts = [encode(tok, p) for p in humaneval_prompts(n)]
    cfg = LocalSSDConfig(pair["draft"], SSDConfig(k=3), verifier_core=0, drafter_core=1)
    with torch.inference_mode():
        forward = forward_ms(target)
    with LocalSSD(target, cfg) as local:
        for r in range(repeats):
            for i, ids in enumerate(prompts):
                for v in variants if (r + i) % 2 == 0 else variants[::-1]:
                    target.pad_rows = v.endswith("pad")
                    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
                    if v.startswith("ar"):
                        seq = Sequence(f"{v}{r}-{i}", list(ids), params, max_len=target.spec.max_positions)
                        stats = run_one(ar_engine, seq)
                    else:
                        local.engine.adaptive = planners[v]
                        _, stats, _ = generate_ssd(local, ids, params, request_id=f"{v}{r}-{i}")
                    runs[v].append((stats.num_generated - 1, stats.decode_s, stats.num_rounds))
    target.pad_rows = True
    tps = {v: sum(t for t, _, _ in x) / sum(s for _, s, _ in x) for v, x in runs.items()}
    out = {v: {"tok_s": round(tps[v], 1), "x_ar": round(tps[v] / tps["ar"], 3),
               "median_request_tok_s": round(statistics.median(t / s for t, s, _ in x), 1),
               "tokens_per_round": round(sum(t for t, _, _ in x) / sum(c for _, _, c in x), 2)} for v, x in runs.items()}
    return {"dtype": dtype, "repeats": repeats, "prompts": n,
            "padded_sizes": pad.padded_sizes() if pad else None,
            "stack_ms_by_rows": [round(s * 1e3, 2) for s in pad.seconds] if pad else None,
            "forward_ms": forward, "results": out}


if __name__ == "__main__":
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])), indent=1))
