"""``ssd bench --sweep k,budget,c``: the best lookahead K, fan-out budget and Saguaro C for a model pair.

Each point is a full interleaved bench run on the same prompts, over the same loaded models (each point starts
its own engines and drafter processes); the best value maximises aggregate decode tokens/s.
  * ``k``: SD and SSD (whichever of them are in ``--modes``) at K = 1..8; reports the best K of each mode;
  * ``budget``: SSD at the best SSD K (or ``--k``) with B in 4, 8, 12, 16, 24 pre-drafted branches per request;
  * ``c``: SSD with Saguaro C in 1, 0.7, 0.5, 0.3. C only changes sampled requests, so this dimension runs at
    the non-zero temperatures of ``--temperatures`` (T = 0.8 if there are none);
  * ``tree``: SSD's candidate tree per outcome (:class:`spec_core.config.TreeShape`), each point beside
    ``ssd-chain`` in the same interleaved run, at the best K and budget: the frontier of tokens per round, tree
    size and tokens/s.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace

from benchmarks.bench import BenchSettings, run_bench
from spec_core.config import ModelConfig
from spec_core.models import load_pair, set_threads

logger = logging.getLogger(__name__)

K_VALUES = tuple(range(1, 9))
BUDGETS = (4, 8, 12, 16, 24)
C_VALUES = (1.0, 0.7, 0.5, 0.3)
TREES = ("4x1", "4,2", "3,2", "5x1", "3,2,2")


def _best(rows: list[dict], key: str) -> object:
    rated = [r for r in rows if r["tokens_per_s"]]
    return max(rated, key=lambda r: r["tokens_per_s"])[key] if rated else None


def _point(settings: BenchSettings, target: ModelConfig, draft: ModelConfig, label: str, value, pair,
           **kw) -> list[dict]:
    sys.stderr.write(f"sweep {label}={value}\n")
    report = run_bench(replace(settings, **kw), target, draft, summary=False, pair=pair)
    return [dict(r, **{label: value}) for r in report["results"]]


def run_sweep(settings: BenchSettings, target: ModelConfig, draft: ModelConfig) -> dict:
    set_threads(settings.target_threads)
    pair = load_pair(target, draft)  # once: what differs between points does not change how the models load
    spec_modes = tuple(m for m in settings.modes if m in ("sd", "ssd")) or ("sd", "ssd")
    out: dict = {"settings": {"modes": spec_modes, "num_prompts": settings.num_prompts,
                              "max_new_tokens": settings.max_new_tokens}}
    best_k = {}
    if "k" in settings.sweep:
        rows = []
        for k in K_VALUES:
            rows += _point(settings, target, draft, "k", k, pair, k=k, sd_k=k, modes=spec_modes, sweep=())
        out["k"] = rows
        best_k = {m: _best([r for r in rows if r["mode"] == m], "k") for m in spec_modes}
        out["best_k"] = best_k
    ssd_k = best_k.get("ssd") or settings.k
    if "budget" in settings.sweep:
        rows = []
        for b in BUDGETS:
            rows += _point(settings, target, draft, "budget", b, pair, k=ssd_k, budget=b, modes=("ssd",), sweep=())
        out["budget"] = rows
        out["best_budget"] = _best(rows, "budget")
    if "c" in settings.sweep:
        temps = tuple(t for t in settings.temperatures if t > 0) or (0.8,)
        rows = []
        for c in C_VALUES:
            rows += _point(settings, target, draft, "saguaro_c", c, pair, k=ssd_k, saguaro_c=c, modes=("ssd",),
                           temperatures=temps, budget=out.get("best_budget") or settings.budget, sweep=())
        out["c"] = rows
        out["best_c"] = _best(rows, "saguaro_c")
    if "tree" in settings.sweep:
        rows = []
        for shape in TREES:
            rows += _point(settings, target, draft, "tree", shape, pair, k=ssd_k, tree=shape, modes=("ssd", "ssd-chain"),
                           budget=out.get("best_budget") or settings.budget, sweep=())
        for r in rows:
            if r["mode"] == "ssd-chain":
                r["tree"] = "chain"
        out["tree"] = rows
        out["best_tree"] = _best([r for r in rows if r["mode"] == "ssd"] or rows, "tree")
    print_sweep(out)
    return out


def print_sweep(out: dict) -> None:
    w = sys.stdout.write
    for dim, key in (("k", "k"), ("budget", "budget"), ("c", "saguaro_c"), ("tree", "tree")):
        if dim not in out:
            continue
        w(f"{'mode':<10}{'T':>5}{key:>11}{'tok/s':>10}{'tok/round':>11}{'hit':>7}{'nodes':>7}\n")
        for r in out[dim]:
            hit, nodes = r.get("cache_hit_rate"), r.get("mean_tree_nodes")
            w(f"{r['mode']:<10}{r['temperature']:>5.2f}{r[key]:>11}{r['tokens_per_s'] or 0:>10.1f}"
              f"{r['mean_tokens_per_round'] or 0:>11.2f}{(f'{hit:.2f}' if hit is not None else '-'):>7}"
              f"{(f'{nodes:.1f}' if nodes is not None else '-'):>7}\n")
    w(f"best: K {out.get('best_k')}, budget {out.get('best_budget')}, C {out.get('best_c')}, "
      f"tree {out.get('best_tree')}\n")
