"""The SSD drafter core (Saguaro): per-outcome pre-drafting with its own paged KV cache, batched over requests.

After the verifier's outcome of round R, for each request the drafter:
  1. takes S_{R+1} from its cache on a hit, or drafts it just in time (K single-token steps, batched);
  2. runs the *glue* forward over ``[bonus, S_{R+1}]`` (the root and the speculation's nodes at their true
     positions, with tree attention when S is a tree), giving the draft distribution after every outcome slot
     (slot 0: the root; slot i + 1: node i, see :mod:`spec_core.speculation`);
  3. forks the top-F_j candidate bonus tokens at every slot j, prompt lookup's guess first (excluding the tokens
     of the slot's own children: after a rejection there the bonus is never one of them under greedy decoding);
  4. decodes K tokens for every branch of every request in K batched forwards with tree attention (a branch sees
     the prefix, the glue along its slot's path and its own earlier tokens; its K/V goes to scratch slots past the
     glue). For greedy requests each step's next ``width - 1`` choices become leaves beside the spine
     (:class:`spec_core.config.TreeShape`), and the outcome's prompt-lookup continuation becomes a branch beside
     it: a candidate tree per outcome, at no extra draft forward;
  5. returns one :class:`BranchBundle` per request: ``(slot, candidate) → Speculation`` with the exact q rows.

Out of KV blocks: a request whose slots do not fit in the pool gets a smaller bundle (trunk only, no branches) or
none at all (its round misses and the verifier uses its backup), and an empty just-in-time draft (the verifier then
decodes one token). Nothing is allocated for it; it drafts again once other requests free blocks. The pool is never
a reason to fail a request.

KV reconciliation: on the next outcome the trunk ``prefix + bonus + S[:j]`` stays, for the j accepted tokens on
S's spine (the glue's K/V at its true positions), and everything past it is truncated; an accepted leaf and the
branch that hit are re-glued next round.

Saguaro sampling: sampled requests draw from q′ = q with the top-F tokens' mass scaled by C (then renormalised) and
ship q′, so the verifier's test and residual stay exact. Coupled requests rank and pick as greedy ones, on their race.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from drafter_service.candidate_trees import (
    GrowingTree,
    LookupStats,
    auto_leaves,
    bonus_candidates,
    glue_mask,
    slot_fanout,
    slot_guesses,
)
from drafter_service.draft_request import DraftRequest, glue_start
from drafter_service.picking import RANK_HEAD, pick_leaves, pick_rows, race_ranking
from spec_core.backends import Backend
from spec_core.backends.default import as_backend
from spec_core.block_manager import BlockManager, NoFreeBlocks
from spec_core.config import SSDConfig, TreeShape, lookup_depth
from spec_core.estimators import AcceptanceEstimator, LinearCost, MissExponentEstimator, RateEstimator
from spec_core.fanout import fanout_for
from spec_core.packing import WorkItem, forward_items
from spec_core.select import topk_rows
from spec_core.sequence import Sequence
from spec_core.speculation import BranchBundle, OutcomeEvent, Speculation, node_depths, path_nodes, slot_positions
from spec_core.transfer import to_device, to_host
from spec_core.tree_draft import DraftRow, draft_trees

logger = logging.getLogger(__name__)

#: Candidate ranks tracked per position for the miss-exponent estimate.
MAX_RANK = 16


class SSDDrafter:
    """Builds speculations and branch bundles for many requests at once. Transport-free (see ``drafter_process``)."""

    def __init__(self, draft: Backend, config: SSDConfig) -> None:
        self.backend = as_backend(draft)  # the model, through the backend protocol only
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.cache = self.backend.new_paged_cache(config.num_blocks, config.block_size)
        self.requests: dict[str, DraftRequest] = {}
        self.acceptance = AcceptanceEstimator()
        #: The n-gram backup's acceptance, for the fan-out of a bundle built on a backup round (the paper's
        #: separate schedule after a miss): its proposals are accepted far less often than the draft's.
        self.backup_acceptance = AcceptanceEstimator(prior_a=0.3)
        self.miss = MissExponentEstimator(max_rank=MAX_RANK)
        #: P(a leaf is accepted | the spine is rejected at a node with leaves), for the tree's fan-out; and per
        #: leaf rank r, P(leaf r is accepted | the spine node and leaves 0..r-1 were rejected), for ``--tree auto``.
        self.leaf = RateEstimator(prior=0.3)
        self.leaf_rank = [RateEstimator(prior=0.3 / (r + 1)) for r in range(8)]
        #: From the verifier's outcomes: one more node's share of its verify, its step seconds by size, others' tokens.
        self.node_cost: float | None = None
        self.step_s: list[float] | None = None
        self.step_others = 0
        self.accept_rate = self.acceptance.value
        self.backup_accept_rate = self.backup_acceptance.value
        self.miss_exponent = self.miss.r
        self.leaf_rate = self.leaf.value
        self.jit_s_per_token = 0.0
        #: Times a request's drafting was cut short because the KV pool was out of blocks.
        self.out_of_blocks = 0
        #: Fitting bundles to the verifier's step (``SSDConfig.fit_fanout``): its step time (from its outcomes),
        #: the fit of a batch of bundles' build time against its work units, and recent seconds per unit.
        self.verify_s: float | None = None
        self.build_cost = LinearCost(decay=0.95)
        self.build_s_per_unit: float | None = None

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def add(self, seq: Sequence, k: int) -> None:
        self.requests[seq.request_id] = DraftRequest(seq=seq, k=min(k, self.config.k))

    def free(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.blocks.free(request_id)

    def _reserve(self, req: DraftRequest, total_tokens: int) -> bool:
        """Grow ``req``'s table to ``total_tokens`` slots, or allocate nothing and return False (pool exhausted)."""
        try:
            self.blocks.ensure(req.seq.request_id, total_tokens)
            return True
        except NoFreeBlocks:
            self.out_of_blocks += 1
            return False

    def _slots(self, rid: str, a: int, b: int) -> list[int]:
        return self.blocks.slots(rid, a, b)

    # ---- sampling -------------------------------------------------------------------------------------------
    def _pick_rows(self, req: DraftRequest, logits: torch.Tensor, positions: list[int]
                   ) -> tuple[list[int], torch.Tensor | None, list[list[int]] | None]:
        """:func:`drafter_service.picking.pick_rows` with this drafter's top-F for Saguaro's down-weighting."""
        top_f = max(fanout_for(self.config.fanout, req.k, self.accept_rate, self.miss_exponent))
        return pick_rows(self.config, req.seq, logits, positions, top_f)

    def _leaves(self, req: DraftRequest, k: int) -> list[int]:
        """Leaves per spine depth for ``req`` (:class:`spec_core.config.TreeShape`)."""
        tree = self.config.tree if req.seq.params.deterministic else self.config.sampled_tree
        return self.leaves_for(k, tree) if tree.auto else tree.leaves(k)

    def leaves_for(self, k: int, tree: TreeShape | None = None) -> list[int]:
        """``--tree auto``: leaves per spine depth for this drafter's measured rates (:func:`auto_leaves`)."""
        return auto_leaves((tree or self.config.tree).leaves(k), self.accept_rate,
                           [r.value for r in self.leaf_rank], self.node_cost)

    def _lookup_keep(self, req: DraftRequest) -> int:
        """How many prompt-lookup nodes ``req``'s trees get in this build: none unless it is greedy and the tree has
        ``lookup``; under ``auto`` each while its measured acceptance pays its verify cost (:class:`LookupStats`)."""
        tree = self.config.tree
        if not (tree.lookup and req.seq.params.deterministic and req.k > 0):
            return 0
        steps = self.step_s if tree.auto and self.config.price_by_step else None
        base = self.step_others + 1 + req.k + sum(self._leaves(req, req.k)) if steps else 0  # all but the branch
        keep = req.lookup_stats.budget(lookup_depth(req.k), self.accept_rate, req.k, base, steps,
                                       self.node_cost if tree.auto else None)
        if keep:
            req.lookup.sync(req.seq.token_ids)
        return keep

    def _slot_guesses(self, req: DraftRequest, s: Speculation) -> list[int | None]:
        """Prompt lookup's guess at the bonus after every outcome slot of ``s``, where ``req``'s trees have a lookup
        branch (``SSDConfig.lookup_bonus``)."""
        if not (self.config.lookup_bonus and self.config.tree.lookup and req.seq.params.deterministic):
            return [None] * (s.num_nodes + 1)
        req.lookup.sync(req.seq.token_ids)
        return slot_guesses(req.lookup, s)

    # ---- just-in-time drafting ------------------------------------------------------------------------------
    def draft_jit(self, reqs: list[DraftRequest]) -> list[Speculation]:
        """K sequential batched steps from each request's pending tokens (the neural backup after a miss)."""
        t0 = time.perf_counter()
        specs = self._draft_jit(reqs)
        steps = max(r.k for r in reqs)
        if steps:
            per_token = (time.perf_counter() - t0) / steps
            self.jit_s_per_token = per_token if not self.jit_s_per_token else 0.7 * self.jit_s_per_token + 0.3 * per_token
        return specs

    def _draft_jit(self, reqs: list[DraftRequest]) -> list[Speculation]:
        """A chain (a one-branch tree, :func:`spec_core.tree_draft.draft_trees`) of K tokens per request that fits
        in the pool (an empty draft otherwise: the verifier then decodes one token)."""
        out = [Speculation([], None, source="jit") for _ in reqs]
        live = [i for i, r in enumerate(reqs) if r.k > 0 and self._reserve(r, r.seq.num_tokens + r.k + 1)]
        if not live:
            return out
        rows = [DraftRow(reqs[i].seq.token_ids, reqs[i].num_computed, reqs[i].k,
                         lambda a, b, rid=reqs[i].seq.request_id: self._slots(rid, a, b)) for i in live]

        leaves = {i: self._leaves(reqs[i], reqs[i].k) for i in live}
        grown = {i: GrowingTree() for i in live}

        def sample(idx: list[int], logits: torch.Tensor, width: int, depth: int):
            picked = []
            for p, j in enumerate(idx):
                i = live[j]
                pos = [reqs[i].seq.num_tokens + depth]
                toks, q, ranked = self._pick_rows(reqs[i], logits[p, :width], pos)
                (side, side_q), = pick_leaves(reqs[i].seq, logits[p, :1], toks, q, pos, leaves[i][depth], ranked)
                grown[i].add(toks[0], q[0] if q is not None else None, side, side_q)
                picked.append((toks, q))
            return picked

        draft_trees(self.backend, self.cache, rows, 1, sample)
        for i in live:
            r = reqs[i]
            r.num_computed = r.seq.num_tokens + r.k - 1  # the chain's K/V but its last token's (speculative)
            keep = self._lookup_keep(r)
            out[i] = grown[i].speculation("jit", r.lookup.propose([], lookup_depth(r.k), 2) if keep else [], keep)
        return out

    # ---- branch bundles -------------------------------------------------------------------------------------
    def build_bundles(self, reqs: list[DraftRequest], specs: list[Speculation],
                      send: Callable[[BranchBundle], None] | None = None) -> list[BranchBundle]:
        """Glue forward, fork, and K batched tree-decode steps for every request (module docstring). A request
        whose K/V does not fit in the pool gets an empty bundle (its next round misses).

        ``send``: called with each bundle once all are built (the link's send, which encodes it). Its time counts
        in the build time that fits the budget to the verifier's step (``fit_fanout``): a bundle is on time only
        once it is on its way, and a sampled bundle's q rows take a quarter of a build to encode."""
        glue = [r.seq.num_tokens - glue_start(r) + s.num_nodes for r, s in zip(reqs, specs)]  # glue forward tokens
        budget = self._fitted_budget(sum(glue), sum(r.k for r in reqs))
        fans = [self._fit_fanout(r, s, budget) for r, s in zip(reqs, specs)]
        kept = [i for i, fan in enumerate(fans) if fan is not None]
        t0 = time.perf_counter()
        built = iter(self._build([reqs[i] for i in kept], [specs[i] for i in kept], [fans[i] for i in kept])
                     if kept else [])
        now = time.perf_counter()
        bundles = [next(built) if fan is not None else BranchBundle(r.seq.request_id, r.round, list(s.token_ids), {},
                                                                    ready_at=now)
                   for r, s, fan in zip(reqs, specs, fans)]
        if send is not None:
            for bundle in bundles:
                send(bundle)
        if kept:
            units = sum(glue[i] + reqs[i].k * sum(fans[i]) for i in kept)
            self._observe_build(units, time.perf_counter() - t0)
        return bundles

    def _fitted_budget(self, glue: int, depth: int) -> int:
        """The per-request fan-out budget for a batch of bundles with ``glue`` glue tokens and ``depth`` decode
        steps summed over its requests (a budget of B decodes B branches for each step): the configured budget, or
        the largest below it whose predicted build time, t0 + t1 (glue + B depth) fitted on past builds, fits
        ``fit_fanout`` of the verifier's step. Until the fit has two sizes: t0 = 0, t1 = recent seconds per unit."""
        full = self.config.fanout.budget
        frac = self.config.fit_fanout
        if frac is None or not self.verify_s or depth <= 0:
            return full
        fit = self.build_cost.coefficients()
        t0, t1 = fit if fit is not None else (0.0, self.build_s_per_unit or 0.0)
        if t1 <= 0:
            return full
        room = frac * self.verify_s - t0 - t1 * glue
        return max(1, min(full, int(room / (t1 * depth))))

    def _observe_build(self, units: int, seconds: float) -> None:
        self.build_cost.observe(units, seconds)
        old, per_unit = self.build_s_per_unit, seconds / max(units, 1)
        self.build_s_per_unit = per_unit if old is None else 0.8 * old + 0.2 * per_unit

    def _fit_fanout(self, r: DraftRequest, s: Speculation, budget: int) -> list[int] | None:
        """The fan-out for ``r`` under ``budget`` with its slots reserved: the full one, else the trunk alone (no
        branches), else None when not even the glue fits."""
        fan = self._slot_fanout(s, budget, r)
        n = r.seq.num_tokens
        if self._reserve(r, n + s.num_nodes + r.k * sum(fan)):
            return fan
        return [0] * len(fan) if self._reserve(r, n + s.num_nodes) else None

    def _slot_fanout(self, s: Speculation, budget: int | None = None, req: DraftRequest | None = None) -> list[int]:
        """F per outcome slot of ``s`` (:func:`slot_fanout`) under ``budget`` (default: the configured one), with
        ``req``'s measured lookup branch; after a backup round, with the backup's own acceptance."""
        fan_cfg = self.config.fanout if budget is None else replace(self.config.fanout, budget=budget)
        a = self.backup_accept_rate if s.source == "backup" else self.accept_rate
        ends = (req.lookup_stats if req is not None else LookupStats()).end
        return slot_fanout(fan_cfg, s, a, self.miss_exponent, self.leaf_rate, [e.value for e in ends])

    def _build(self, reqs: list[DraftRequest], specs: list[Speculation], fans: list[list[int]]) -> list[BranchBundle]:
        glue_items = []
        for r, s in zip(reqs, specs):
            rid, n = r.seq.request_id, r.seq.num_tokens
            c = glue_start(r)
            pending = r.seq.token_ids[c:]
            glue_items.append(WorkItem(self._slots(rid, 0, c), pending + s.token_ids,
                                       list(range(c, n)) + [n - 1 + d for d in node_depths(s.tree_parents)],
                                       self._slots(rid, c, n + s.num_nodes), len(pending), s.tree_parents,
                                       list(range(n - 1 - c, n - c + s.num_nodes))))
        glue_logits = forward_items(self.backend, self.cache, glue_items)
        branches: list[list[tuple[int, int]]] = []
        for i, (r, s, fan) in enumerate(zip(reqs, specs, fans)):
            r.num_computed = r.seq.num_tokens + s.k  # glue K/V valid through S's spine (speculatively)
            r.base_source, r.base_lookup = s.source, s.lookup_from
            roots = []
            r.candidates = {}
            ranked_rows = self._ranked_slots(r, s, glue_logits[i, : s.num_nodes + 1], max(fan))
            for j, ranked in enumerate(bonus_candidates(ranked_rows, s.tree_parents, s.token_ids,
                                                        self._slot_guesses(r, s))):
                r.candidates[j] = ranked[:MAX_RANK]
                roots.extend((j, t) for t in ranked[: fan[j]])
            branches.append(roots)
        return self._decode_branches(reqs, specs, branches)

    def _ranked_slots(self, r: DraftRequest, s: Speculation, rows: torch.Tensor, fan: int) -> list[list[int]]:
        """The candidate bonus tokens after each outcome slot of ``s`` (glue ``rows [N+1, V]``), best first, at
        least ``fan`` and ``MAX_RANK`` of them: the draft's likeliest (a coupled request's: its race at the slot's
        position), without the slot's own children (after a rejection there the bonus is never one of them)."""
        width = min(rows.shape[-1], max(fan, min(MAX_RANK, rows.shape[-1] - 1)))
        if r.seq.params.coupled:
            children: list[set[int]] = [set() for _ in range(s.num_nodes + 1)]
            for par, tok in zip(s.tree_parents, s.token_ids):
                children[par + 1].add(tok)
            ranked = race_ranking(r.seq, rows, slot_positions(r.seq.num_tokens, s.tree_parents),
                                  max(RANK_HEAD, width + max(map(len, children))))
            return [[t for t in row if t not in kids][:width] for row, kids in zip(ranked, children)]
        if s.num_nodes:
            rows = rows.clone()
            drafted = to_device([[p + 1 for p in s.tree_parents], s.token_ids], rows.device, torch.long)
            rows[drafted[0], drafted[1]] = float("-inf")
        return to_host(topk_rows(rows, width)[1])  # one download per request

    def _decode_branches(self, reqs, specs, branches) -> list[BranchBundle]:
        now_tokens = [[c for _, c in br] for br in branches]
        grown = [[GrowingTree() for _ in br] for br in branches]
        # Each branch's slot: the glue nodes it sees (root + its path) and its depth (the bonus sits at n + depth).
        paths = [[path_nodes(s.parents, j) for j, _ in br] for s, br in zip(specs, branches)]
        leaves = [self._leaves(r, r.k) for r in reqs]
        k_max = max((r.k for r in reqs), default=0)
        # What each branch sees of its request's glue (the root and its outcome's path): the same at every step.
        glue_masks = [glue_mask(p, s.num_nodes + 1) for p, s in zip(paths, specs)]
        for step in range(k_max):
            items, live = [], []
            for i, (r, s, br) in enumerate(zip(reqs, specs, branches)):
                if step >= r.k or not br:
                    continue
                live.append(i)
                rid, n, m = r.seq.request_id, r.seq.num_tokens, len(br)
                base = n + s.num_nodes  # first scratch position (slots only; RoPE positions are the true ones)
                glue = self._slots(rid, n - 1, n + s.num_nodes)
                earlier = self._slots(rid, base, base + step * m)
                # ... and its own earlier tokens: branch b's are every m-th scratch slot from b
                mask = torch.cat([glue_masks[i], torch.eye(m, dtype=torch.bool).repeat(1, step)], dim=1)
                items.append(WorkItem(self._slots(rid, 0, n - 1), [now_tokens[i][b] for b in range(m)],
                                      [n + len(path) + step for path in paths[i]],
                                      self._slots(rid, base + step * m, base + (step + 1) * m),
                                      0, [-1] * m, list(range(m)), extra_slots=glue + earlier, extra_mask=mask))
            logits = forward_items(self.backend, self.cache, items)
            for j, i in enumerate(live):
                m = len(branches[i])
                n = reqs[i].seq.num_tokens  # a branch at depth a drafts from position n + a + 1 on
                positions = [n + len(p) + step + 1 for p in paths[i]]
                toks, qs, ranked = self._pick_rows(reqs[i], logits[j, :m], positions)
                sides = pick_leaves(reqs[i].seq, logits[j, :m], toks, qs, positions, leaves[i][step], ranked)
                for b, (tok, (side, side_q)) in enumerate(zip(toks, sides)):
                    grown[i][b].add(tok, qs[b] if qs is not None else None, side, side_q)
                    now_tokens[i][b] = tok
        now = time.perf_counter()
        bundles = []
        for i, (r, br) in enumerate(zip(reqs, branches)):
            keep = self._lookup_keep(r)
            path_tokens = [[specs[i].token_ids[p] for p in path] for path in paths[i]]
            lookups = [r.lookup.propose(path + [key[1]], lookup_depth(r.k), 2) if keep else []  # the outcome's context
                       for path, key in zip(path_tokens, br)]
            entries = {key: grown[i][b].speculation("cache", lookups[b], keep) for b, key in enumerate(br)}
            bundles.append(BranchBundle(r.seq.request_id, r.round, list(specs[i].token_ids), entries, ready_at=now,
                                        base_parents=specs[i].parents))
        return bundles

    def observe(self, req: DraftRequest, ev: OutcomeEvent) -> None:
        """Feed the estimators with a real outcome of this drafter's own speculation: the spine's acceptance, the
        leaves' (when the spine was rejected where it had leaves), the lookup branch's, and the bonus's rank."""
        spine = Speculation(ev.verified, parents=ev.parents).k
        on_spine, path = ev.spine_accepted, ev.path
        first = len(ev.verified) if req.base_lookup is None else req.base_lookup  # the lookup branch's first node
        off = bool(path) and spine <= path[-1] < first  # the round ended on a leaf
        if spine > 0:
            (self.backup_acceptance if req.base_source == "backup" else self.acceptance).update(on_spine, spine)
        req.lookup_stats.observe(first, len(ev.verified), path)
        beside = [i for i in range(spine, first) if ev.parents and ev.parents[i] == on_spine - 1]
        if on_spine < spine and beside:
            self.leaf.update(off)
            taken = ev.path[-1] if off else None
            for r, node in enumerate(beside[: len(self.leaf_rank)]):
                self.leaf_rank[r].update(node == taken)
                if node == taken:
                    break
        ranked = req.candidates.get(ev.key[0])
        if ranked is not None:
            self.miss.update(ranked.index(ev.bonus) + 1 if ev.bonus in ranked else None)

    def refresh_estimates(self) -> None:
        self.accept_rate = self.acceptance.value
        self.backup_accept_rate = self.backup_acceptance.value
        self.miss_exponent = self.miss.r
        self.leaf_rate = self.leaf.value

    def commit_outcome(self, req: DraftRequest, accepted: list[int], bonus: int, kv_accepted: int) -> None:
        """Append the real outcome; keep the trunk K/V (prefix + the first ``kv_accepted`` accepted tokens, those
        whose K/V this drafter wrote at their true positions: the accepted part of its own speculation's spine)
        and drop everything past it. For a speculation not its own (a backup's) ``kv_accepted`` is 0."""
        n_before = req.seq.num_tokens
        valid = min(req.num_computed, n_before + kv_accepted)
        req.seq.output_ids.extend(accepted + [bonus])
        req.num_computed = valid
        if req.seq.request_id in self.blocks.tables:
            self.blocks.commit(req.seq.request_id, valid)
