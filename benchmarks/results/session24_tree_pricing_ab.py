"""Session 24: SSD trees with the lookup branch priced by the verifier's step-time staircase against the per-node
slope (before), and chains, at batch 1 (#15).

    python benchmarks/results/session24_tree_pricing_ab.py bfloat16 2 8      # dtype, repeats, prompts

One target; one ``LocalSSD`` per variant (each its own drafter process on the other core, as ``ssd bench`` runs
``ssd`` and ``ssd-chain``) with its own adaptive planner; variants interleaved prompt by prompt (the order reversed
every other one), 128 greedy tokens on HumanEval.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from benchmarks.results.session21_planner_ab import _target
from cluster.local_ssd import LocalSSD, LocalSSDConfig, generate_ssd
from spec_core.chat import encode
from spec_core.config import SamplingParams, SSDConfig, TreeShape
from spec_core.model_paths import default_pair
from spec_core.models import load_tokenizer
from spec_core.prompts import humaneval_prompts
from verifier_service.adaptive import AdaptiveK

VARIANTS = {"chain": SSDConfig(k=3, tree=TreeShape.parse("chain")),
            "tree-slope": SSDConfig(k=3),
            "tree-stair": SSDConfig(k=3, price_by_step=True)}


def main(dtype: str, repeats: int, n: int) -> dict:
    pair = default_pair()
    target = _target(dtype)
    tok = load_tokenizer(pair["target"])
    prompts = [encode(tok, p) for p in humaneval_prompts(n)]
    locals_ = {}
    for v, cfg in VARIANTS.items():
        locals_[v] = LocalSSD(target, LocalSSDConfig(pair["draft"], cfg, verifier_core=0, drafter_core=1)).__enter__()
        locals_[v].engine.adaptive = AdaptiveK(k_max=3)
    runs: dict[str, list] = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    try:
        for r in range(repeats):
            for i, ids in enumerate(prompts):
                for v in names if (r + i) % 2 == 0 else names[::-1]:
                    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
                    _, stats, ssd = generate_ssd(locals_[v], ids, params, request_id=f"{v}{r}-{i}")
                    runs[v].append((stats.num_generated - 1, stats.decode_s, stats.num_rounds, ssd))
    finally:
        for local in locals_.values():
            local.__exit__(None, None, None)
    out = {}
    for v, x in runs.items():
        tok_s = sum(t for t, *_ in x) / sum(s for _, s, *_ in x)
        out[v] = {"tok_s": round(tok_s, 1), "median_request_tok_s": round(statistics.median(t / s for t, s, *_ in x), 1),
                  "tokens_per_round": round(sum(t for t, *_ in x) / sum(c for _, _, c, _ in x), 3),
                  **{k: round(statistics.mean(e[k] or 0.0 for *_, e in x), 3)
                     for k in ("cache_hit_rate", "mean_tree_nodes", "lookup_tokens_per_round")}}
    for v in ("tree-slope", "tree-stair"):
        out[v]["x_chain_tok_s"] = round(out[v]["tok_s"] / out["chain"]["tok_s"], 3)
        out[v]["x_chain_tokens_per_round"] = round(out[v]["tokens_per_round"] / out["chain"]["tokens_per_round"], 3)
    return {"dtype": dtype, "repeats": repeats, "prompts": n, "results": out}


if __name__ == "__main__":
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])), indent=1))
