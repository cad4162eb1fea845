"""Session 23: what a prompt-lookup branch can add to a K = 3 candidate tree, with this draft (#15).

    python benchmarks/results/session23_lookup_bound.py 8 128        # HumanEval prompts, tokens each

As in ``session22_tree_bound.py`` (whose :func:`decode` this reuses): the target (bf16) decodes each prompt
greedily and the draft reads the result in one forward, so on hit rounds (whose accepted path is the target's own tokens) every tree's tokens per round
follow from the draft's rank of each target token. A lookup branch of depth L is what followed the latest earlier
match of the context's last 3 (down to ``min_n``) tokens; a tree holding the draft's spine and that branch accepts
the longer of their matches. Also: how often lookup names the target's next token where the draft's top choice is
wrong (the outcome's bonus after a rejection), against the draft's next two choices.
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.results.session22_tree_bound import decode
from spec_core.ngram import propose_ngram

K = 3


def _matched(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def union(data, depth: int, min_n: int) -> dict:
    chain = tree = nodes = 0
    count = 0
    for full, p, rk in data:
        for s in range(len(rk) - max(K, depth)):
            a = next((d for d in range(K) if rk[s + d] != 0), K)  # the draft spine's accepted tokens
            ng = propose_ngram(full[: p + s], depth, min_n=min_n)
            g = _matched(ng, full[p + s:])
            nodes += len(ng) - min(g, a) if g < len(ng) or g > a else 0
            chain, tree, count = chain + a + 1, tree + max(a, g) + 1, count + 1
    return {"depth": depth, "min_n": min_n, "chain": round(chain / count, 3), "tree": round(tree / count, 3),
            "x_chain": round(tree / chain, 3), "lookup_nodes": round(nodes / count, 2)}


def bonus_guess(data) -> dict:
    wrong = lookup = ranks12 = 0
    for full, p, rk in data:
        for s, r in enumerate(rk):
            if r == 0:
                continue
            wrong += 1
            ranks12 += r in (1, 2)
            lookup += propose_ngram(full[: p + s], 1)[:1] == [full[p + s]]
    return {"draft_top1_wrong": wrong, "lookup_right": round(lookup / wrong, 3),
            "draft_rank_1_or_2": round(ranks12 / wrong, 3)}


if __name__ == "__main__":
    torch.set_num_threads(2)
    data = decode(int(sys.argv[1]), int(sys.argv[2]))
    print(json.dumps({"union": [union(data, d, m) for d in (3, 6) for m in (1, 2)], "bonus": bonus_guess(data)},
                     indent=1))
