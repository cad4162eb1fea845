"""The draft model's batched engine: its own paged KV cache, batched chain and tree proposals, reconciliation.

A proposal for a request whose tokens are ``x[0..n-1]`` is a :class:`TokenTree` rooted at ``x[n-1]`` (the last
token, not yet verified). Shape: ``branching`` children of the root, each extended by a chain to depth ``k``
(``branching == 1`` is a plain chain). Node i sits at the slot of position ``n + i`` (see
:mod:`spec_core.packing`), so one batched forward per depth level decodes every branch of every request.

Each node carries the exact distribution it was sampled from (``draft_probs`` row), which is what the verifier
uses as q. Greedy requests take the top-``branching`` tokens at the root and argmax below; sampled requests draw
the root children i.i.d. from q (the SpecInfer multi-branch rule assumes sampling with replacement).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from spec_core.block_manager import BlockManager, NoFreeBlocks
from spec_core.packing import WorkItem, forward_items, reconcile_tree_slots
from spec_core.runner import ModelRunner
from spec_core.sampling import request_probs, sample_from_probs
from spec_core.sequence import Sequence
from spec_core.transfer import to_host
from spec_core.tree import TokenTree

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DraftConfig:
    k: int = 5
    branching: int = 1
    num_blocks: int = 512
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.k < 0 or self.branching < 1:
            raise ValueError(f"k must be >= 0 and branching >= 1, got k={self.k}, branching={self.branching}")

    @property
    def max_nodes(self) -> int:
        return self.k * self.branching


class BatchDrafter:
    """Proposes speculation trees for a batch of requests with a draft model."""

    def __init__(self, runner: ModelRunner, config: DraftConfig) -> None:
        self.runner = runner
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.cache = runner.new_paged_cache(config.num_blocks, config.block_size)
        self.draft_s = 0.0

    def observe_verify_time(self, seconds: float) -> None:
        """Synchronous drafting needs no verify-time estimate."""

    def release(self, seq: Sequence) -> None:
        self.blocks.free(seq.request_id)
        seq.num_draft_computed = 0

    def _slots(self, seq: Sequence):
        return lambda a, b: self.blocks.slots(seq.request_id, a, b)

    def _reserve(self, seq: Sequence, nodes: int) -> bool:
        try:
            self.blocks.ensure(seq.request_id, seq.num_tokens + nodes)
            return True
        except NoFreeBlocks:
            return False

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[TokenTree]:
        """One tree per request, with ``ks[i]`` levels (0 = no speculation)."""
        t0 = time.perf_counter()
        b = self.config.branching
        trees = [TokenTree(parents=[], token_ids=[], draft_probs=None) for _ in seqs]
        active = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k > 0 and self._reserve(s, k * b)]
        if active:
            trees_active = self._propose_trees([seqs[i] for i in active], [ks[i] for i in active])
            for i, tree in zip(active, trees_active):
                trees[i] = tree
        self.draft_s += time.perf_counter() - t0
        return trees

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, width: int, root: bool):
        """Pick ``width`` tokens per request from ``logits [B, W, V]``; returns (probs or None, picks).

        Greedy requests need no distributions (the verifier checks argmax only), so none are computed for them.
        """
        greedy = [s.params.greedy for s in seqs]
        probs = None if all(greedy) else request_probs(logits, [s.params for s in seqs])
        picks = torch.topk(logits[:, 0], width).indices if root else logits[:, :width].argmax(-1)
        for i, seq in enumerate(seqs):
            if not greedy[i]:
                src = probs[i, :1].expand(width, -1) if root else probs[i, :width]
                picks[i] = sample_from_probs(src, seq.uniforms(width))
        return probs, to_host(picks)  # one download for the whole batch

    def _propose_trees(self, seqs: list[Sequence], ks: list[int]) -> list[TokenTree]:
        b = self.config.branching
        n = [s.num_tokens for s in seqs]
        # Level 0: catch up on pending tokens (prompt or last accepted ones) and read the root distribution.
        items = []
        for s, ni in zip(seqs, n):
            c = s.num_draft_computed
            slots = self._slots(s)
            items.append(WorkItem(slots(0, c), s.token_ids[c:], list(range(c, ni)), slots(c, ni), ni - c, [],
                                  [ni - c - 1]))
        logits = forward_items(self.runner, self.cache, items)
        for s, ni in zip(seqs, n):
            s.num_draft_computed = ni
        probs, picks = self._sample(seqs, logits, b, root=True)
        parents = [[-1] * b for _ in seqs]
        tokens = [list(p) for p in picks]
        rows: list[list[torch.Tensor]] = [[probs[i, 0]] * b if probs is not None else [] for i in range(len(seqs))]
        for depth in range(1, max(ks)):
            live = [i for i, k in enumerate(ks) if k > depth]
            items = []
            for i in live:
                s, ni = seqs[i], n[i]
                slots = self._slots(s)
                fed = list(range((depth - 1) * b, depth * b))
                earlier = list(range(0, (depth - 1) * b))
                extra_mask = (torch.arange(len(earlier)) % b)[None, :] == (torch.arange(len(fed)) % b)[:, None]
                items.append(WorkItem(
                    slots(0, ni), [tokens[i][f] for f in fed], [ni - 1 + depth] * b,
                    [slots(ni + f, ni + f + 1)[0] for f in fed], 0, [-1] * b, list(range(b)),
                    extra_slots=[slots(ni + e, ni + e + 1)[0] for e in earlier],
                    extra_mask=extra_mask.view(b, len(earlier)),
                ))
            logits = forward_items(self.runner, self.cache, items)
            sub = [seqs[i] for i in live]
            probs, picks = self._sample(sub, logits, b, root=False)
            for j, i in enumerate(live):
                for f in range(b):
                    parents[i].append((depth - 1) * b + f)
                    tokens[i].append(picks[j][f])
                    if probs is not None:
                        rows[i].append(probs[j, f])
        return [TokenTree(parents=parents[i], token_ids=tokens[i],
                          draft_probs=None if seqs[i].params.greedy else torch.stack(rows[i]))
                for i in range(len(seqs))]

    def commit(self, seq: Sequence, n: int, tree: TokenTree, path: list[int], next_k: int = 0) -> None:
        """Keep the draft K/V of the real outcome: ``x[0..n-1]`` plus the accepted nodes the draft already fed.

        Nodes of the last level were sampled but never fed, so they have no K/V yet.
        """
        rid = seq.request_id
        if rid not in self.blocks.tables or tree.num_nodes == 0:
            return
        depth = tree.num_nodes // self.config.branching
        usable = path[: max(0, depth - 1)]  # nodes at depth < k were fed; the path descends one level per node
        src, dst = reconcile_tree_slots(self._slots(seq), n, usable)
        self.cache.copy_slots(src, dst)
        seq.num_draft_computed = n + len(usable)
        self.blocks.commit(rid, n + len(usable))
