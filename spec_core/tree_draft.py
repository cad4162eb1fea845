"""The one drafting loop: token trees (a chain is a one-branch tree) for a ragged batch, one batched draft forward
per depth level, over a paged draft cache.

Used by SD's in-process draft engine (:mod:`spec_core.draft_engine`) and by the SSD drafter's just-in-time drafts
(:mod:`drafter_service.ssd_drafter`); they differ only in how a level's tokens are picked (the ``sample``
callback: plain q, or Saguaro's q′ over the top-n) and in their KV bookkeeping, which stays with the caller.

Layout (see :mod:`spec_core.packing`): for a request of tokens ``x[0..n-1]`` the tree hangs from ``x[n-1]``.
Level 0 feeds the pending tokens ``x[c..n-1]`` (c = tokens already in the draft cache) and picks ``branching``
root children; level d ≥ 1 feeds the nodes of depth d (at position n - 1 + d, slot of position n + node index)
and picks one child for each. Each level's new tokens see the prefix, their own branch's earlier nodes and
themselves. After ``k`` levels the nodes of depth < k have K/V; the last level's have none yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spec_core.kv_cache import PagedKVCache
from spec_core.packing import PagedModel, WorkItem, forward_items


@dataclass(slots=True)
class DraftRow:
    """One request's share of a drafting pass. Its blocks (through ``n + k * branching`` tokens) are reserved."""

    token_ids: list[int]
    num_computed: int
    k: int
    slots: Callable[[int, int], list[int]]


#: ``sample(rows, logits [B, W, V], width, depth)`` → for each of ``rows`` (indices into the pass), ``width`` picked
#: tokens and the q rows they were drawn from (``[width, V]``, or None for greedy requests). At the root (depth 0)
#: the ``width`` picks are drawn from row 0's distribution (repeated ``width`` times); below it, pick j from row j.
#: The picked tokens of depth d sit at position ``len(token_ids) + d`` (what keyed uniforms are keyed by).
Sampler = Callable[[list[int], torch.Tensor, int, int], list[tuple[list[int], torch.Tensor | None]]]


@dataclass(slots=True)
class DraftedTree:
    parents: list[int]
    token_ids: list[int]
    q_rows: list[torch.Tensor]  # one per node, empty for greedy requests


def draft_trees(model: PagedModel, cache: PagedKVCache, rows: list[DraftRow], branching: int,
                sample: Sampler) -> list[DraftedTree]:
    """Draft a ``branching``-wide tree of depth ``rows[i].k`` for every row (``k >= 1``)."""
    b = branching
    n = [len(r.token_ids) for r in rows]
    items = [WorkItem(r.slots(0, r.num_computed), r.token_ids[r.num_computed:], list(range(r.num_computed, ni)),
                      r.slots(r.num_computed, ni), ni - r.num_computed, [], [ni - r.num_computed - 1])
             for r, ni in zip(rows, n)]
    picked = sample(list(range(len(rows))), forward_items(model, cache, items), b, 0)
    trees = [DraftedTree([-1] * b, list(toks), list(q.unbind(0)) if q is not None else []) for toks, q in picked]
    for depth in range(1, max(r.k for r in rows)):
        live = [i for i, r in enumerate(rows) if r.k > depth]
        items = [_level_item(rows[i], n[i], depth, b, trees[i].token_ids) for i in live]
        for i, (toks, q) in zip(live, sample(live, forward_items(model, cache, items), b, depth)):
            tree = trees[i]
            tree.parents.extend(range((depth - 1) * b, depth * b))
            tree.token_ids.extend(toks)
            if q is not None:
                tree.q_rows.extend(q.unbind(0))
    return trees


def _level_item(row: DraftRow, n: int, depth: int, b: int, tokens: list[int]) -> WorkItem:
    """Feed the ``b`` nodes of depth ``depth`` (indices (depth-1)·b ...); each sees its own branch's ancestors."""
    fed = list(range((depth - 1) * b, depth * b))
    earlier = list(range(0, (depth - 1) * b))
    extra_mask = (torch.arange(len(earlier)) % b)[None, :] == (torch.arange(len(fed)) % b)[:, None]
    slot = lambda i: row.slots(n + i, n + i + 1)[0]  # noqa: E731
    return WorkItem(row.slots(0, n), [tokens[f] for f in fed], [n - 1 + depth] * b, [slot(f) for f in fed], 0,
                    [-1] * b, list(range(b)), extra_slots=[slot(e) for e in earlier],
                    extra_mask=extra_mask.view(b, len(earlier)))
