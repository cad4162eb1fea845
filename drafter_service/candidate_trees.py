"""Candidate trees for SSD's speculations: the leaves beside a spine, a tree grown level by level, and how many
leaves ``--tree auto`` keeps (:class:`spec_core.config.TreeShape`). Pure functions over logits and rates."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spec_core.speculation import Speculation, spine_tree
from spec_core.transfer import to_host


def leaf_tokens(logits: torch.Tensor, spine: list[int], extra: int) -> list[list[int]]:
    """For each row of ``logits [m, V]``, its ``extra`` likeliest tokens other than the row's spine token (the
    leaves beside it; excluding it explicitly keeps them distinct when logits tie)."""
    top = to_host(torch.topk(logits, extra + 1, dim=-1).indices)
    return [[t for t in row if t != tok][:extra] for row, tok in zip(top, spine)]


@dataclass(slots=True)
class GrowingTree:
    """One speculation being drafted level by level: the spine's tokens and q rows, and the leaves beside each
    spine node with theirs (a sampled leaf's row is its spine node's: siblings are i.i.d. draws from one q)."""

    spine: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    leaves: list[list[int]] = field(default_factory=list)
    leaf_q: list[torch.Tensor] = field(default_factory=list)

    def add(self, token: int, q_row: torch.Tensor | None, leaves: list[int], leaf_q: torch.Tensor | None) -> None:
        self.spine.append(token)
        self.leaves.append(leaves)
        if q_row is not None:
            self.q.append(q_row)
            if leaf_q is not None:
                self.leaf_q.append(leaf_q)

    def speculation(self, source: str = "cache") -> Speculation:
        tokens, parents = spine_tree(self.spine, self.leaves)
        probs = torch.cat([torch.stack(self.q), *self.leaf_q]) if self.q else None
        return Speculation(tokens, probs, source, parents)


def auto_leaves(cap: list[int], accept_rate: float, leaf_rates: list[float], node_cost: float | None) -> list[int]:
    """Leaves per spine depth, up to ``cap``, each kept while it pays.

    Leaf r beside spine node d adds ``P(reach d) · (1 - a) · P(no earlier leaf) · ρ_r`` expected tokens per round
    (a: the spine's acceptance, ρ_r: leaf rank r's measured acceptance, ``leaf_rates[r]``); it costs one tree node,
    which slows the round by the verifier's measured ``node_cost`` (a fraction of its verify) and so is worth
    ``node_cost · E[tokens per round]`` tokens. Without a measured cost, the cap."""
    if node_cost is None:
        return list(cap)
    k = len(cap)
    a = min(accept_rate, 0.999)
    price = node_cost * (1 - a ** (k + 1)) / (1 - a)
    out, reach = [], 1.0
    for d in range(k):
        left, n = reach * (1 - a), 0  # P(the spine is rejected here and no leaf so far was accepted)
        while n < min(cap[d], len(leaf_rates)) and left * leaf_rates[n] > price:
            left *= 1 - leaf_rates[n]
            n += 1
        out.append(n)
        reach *= a
    return out
