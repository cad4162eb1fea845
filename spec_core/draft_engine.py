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

from spec_core.backends import Backend
from spec_core.backends.default import as_backend
from spec_core.block_manager import BlockManager, NoFreeBlocks
from spec_core.config import DEFAULT_K
from spec_core.coupling import keys_tensor, race_scores
from spec_core.packing import reconcile_tree_slots
from spec_core.sampling import request_probs, sample_from_probs
from spec_core.select import argmax_rows, topk_rows
from spec_core.sequence import DRAFT, Sequence
from spec_core.transfer import to_device, to_host
from spec_core.tree import TokenTree
from spec_core.tree_draft import DraftRow, draft_trees

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DraftConfig:
    k: int = DEFAULT_K
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

    def __init__(self, draft: Backend, config: DraftConfig) -> None:
        self.backend = as_backend(draft)  # the model, through the backend protocol only
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.cache = self.backend.new_paged_cache(config.num_blocks, config.block_size)
        self.draft_s = 0.0

    def observe_verify_time(self, seconds: float, tokens: int = 0) -> None:
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

    def _sampler(self, seqs: list[Sequence]):
        """The :data:`spec_core.tree_draft.Sampler` of SD: plain q per request; greedy requests take the top
        ``width`` tokens at the root and the argmax below, and need no distributions (the verifier checks argmax
        only). Sampled requests draw the root children i.i.d. (SpecInfer's rule samples with replacement). Coupled
        requests are greedy ones on their race scores (:mod:`spec_core.coupling`)."""

        def sample(rows: list[int], logits: torch.Tensor, width: int, depth: int):
            root = depth == 0
            sub = [seqs[i] for i in rows]
            greedy = [s.params.deterministic for s in sub]
            coupled = [j for j, s in enumerate(sub) if s.params.coupled]
            if coupled:
                logits = logits.clone()
                for j in coupled:  # each row of this level picks the token at num_tokens + depth
                    w, seq = logits.shape[1], sub[j]
                    logits[j] = race_scores(request_probs(logits[j][None], [seq.params])[0],
                                            keys_tensor(seq.seed, [seq.num_tokens + depth] * w, logits.device))
            probs = None if all(greedy) else request_probs(logits, [s.params for s in sub])
            picks = topk_rows(logits[:, 0], width)[1] if root else argmax_rows(logits[:, :width])
            drawn = [j for j, g in enumerate(greedy) if not g]
            uniforms = to_device(torch.stack([sub[j].uniforms_at(sub[j].num_tokens + depth, width, DRAFT)
                                              for j in drawn]), logits.device) if drawn else None  # one upload
            qs: list[torch.Tensor | None] = [None] * len(sub)
            for i, j in enumerate(drawn):
                qs[j] = probs[j, :1].expand(width, -1) if root else probs[j, :width]
                picks[j] = sample_from_probs(qs[j], uniforms[i])
            return list(zip(to_host(picks), qs))  # one download for the whole level

        return sample

    def _propose_trees(self, seqs: list[Sequence], ks: list[int]) -> list[TokenTree]:
        rows = [DraftRow(s.token_ids, s.num_draft_computed, k, self._slots(s)) for s, k in zip(seqs, ks)]
        drafted = draft_trees(self.backend, self.cache, rows, self.config.branching, self._sampler(seqs))
        for s in seqs:
            s.num_draft_computed = s.num_tokens  # level 0 fed the pending tokens; the nodes stay speculative
        return [TokenTree(parents=d.parents, token_ids=d.token_ids,
                          draft_probs=None if s.params.deterministic else torch.stack(d.q_rows))
                for s, d in zip(seqs, drafted)]

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
