"""The SSD drafter core (Saguaro): per-outcome pre-drafting with its own paged KV cache, batched over requests.

After the verifier's outcome of round R, for each request the drafter:
  1. takes S_{R+1} from its cache on a hit, or drafts it just in time (K single-token steps, batched);
  2. runs the *glue* forward over ``[bonus, S_{R+1}]`` (K+1 tokens at their true positions), giving the draft
     distributions L_0..L_K after each prefix of the speculation;
  3. forks the top-F_j candidate bonus tokens at every position j (excluding the drafted token S[j] for j < K:
     after a rejection at j the bonus is never S[j] under greedy decoding and rarely under sampling);
  4. decodes K tokens for every branch of every request in K batched forwards with tree attention (a branch sees
     the prefix, ``glue[0..j]`` and its own earlier tokens; its K/V goes to scratch slots past the glue);
  5. returns one :class:`BranchBundle` per request: ``(j, candidate) → Speculation`` with the exact q rows.

Out of KV blocks: a request whose slots do not fit in the pool gets a smaller bundle (trunk only, no branches) or
none at all (its round misses and the verifier uses its backup), and an empty just-in-time draft (the verifier then
decodes one token). Nothing is allocated for it; it drafts again once other requests free blocks. The pool is never
a reason to fail a request.

KV reconciliation: on the next outcome (k accepted) the trunk ``prefix + bonus + S[:k]`` stays (it is the glue's
K/V at its true positions) and everything past it is truncated; the branch that hit is re-glued next round.

Saguaro sampling: sampled requests draw from q′ = q with the top-F tokens' mass scaled by C (then renormalised) and
ship q′, so the verifier's acceptance test and residual use q′ and stay exact.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from drafter_service.estimators import AcceptanceEstimator, MissExponentEstimator
from spec_core.block_manager import BlockManager, NoFreeBlocks
from spec_core.config import SSDConfig
from spec_core.fanout import fanout_for
from spec_core.packing import WorkItem, forward_items
from spec_core.runner import ModelRunner
from spec_core.sampling import request_probs, saguaro_downweight, sample_from_probs, truncate_top_n
from spec_core.sequence import DRAFT, Sequence
from spec_core.speculation import BranchBundle, Speculation
from spec_core.transfer import to_device, to_host
from spec_core.tree_draft import DraftRow, draft_trees

logger = logging.getLogger(__name__)

#: Candidate ranks tracked per position for the miss-exponent estimate.
MAX_RANK = 16


@dataclass(slots=True)
class DraftRequest:
    """The drafter's view of one request: its tokens (the last is the latest bonus) and K/V progress."""

    seq: Sequence
    k: int
    num_computed: int = 0
    round: int = -1
    bundle: BranchBundle | None = None
    #: Per glue position j: the draft's ranked candidate bonus tokens (drafted token excluded), for r's estimate.
    candidates: dict[int, list[int]] = field(default_factory=dict)


class SSDDrafter:
    """Builds speculations and branch bundles for many requests at once. Transport-free (see ``drafter_process``)."""

    def __init__(self, runner: ModelRunner, config: SSDConfig) -> None:
        self.runner = runner
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.cache = runner.new_paged_cache(config.num_blocks, config.block_size)
        self.requests: dict[str, DraftRequest] = {}
        self.acceptance = AcceptanceEstimator()
        self.miss = MissExponentEstimator(max_rank=MAX_RANK)
        self.accept_rate = self.acceptance.value
        self.miss_exponent = self.miss.r
        self.jit_s_per_token = 0.0
        #: Times a request's drafting was cut short because the KV pool was out of blocks.
        self.out_of_blocks = 0

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
                   ) -> tuple[list[int], torch.Tensor | None]:
        """One token per row of ``logits [m, V]``, all rows at once: argmax for greedy, else draws from
        Saguaro's q′ truncated to the top-n (returned, ``[m, V]``: the exact rows the tokens were drawn from).
        Row i's token sits at ``positions[i]``; its uniform is keyed by that position, so a pre-drafted branch and
        a just-in-time draft from the same prefix pick the same tokens."""
        seq = req.seq
        if seq.params.greedy:
            return to_host(logits.argmax(-1)), None
        uniforms = torch.cat([seq.uniforms_at(p, 1, DRAFT) for p in positions])
        top_f = max(fanout_for(self.config.fanout, req.k, self.accept_rate, self.miss_exponent))
        n, vocab = self.config.proposal_top_n, logits.shape[-1]
        if self.config.ship_raw_q or not 0 < n < vocab:
            q = request_probs(logits[None], [seq.params])[0]
            q_prime = truncate_top_n(saguaro_downweight(q, top_f, self.config.saguaro_c), n)
            toks = to_host(sample_from_probs(q_prime, uniforms))
            return toks, q if self.config.ship_raw_q else q_prime
        # Work on the top-n logits only: the proposal is the (temperature, top-k/top-p, Saguaro) distribution
        # over the draft's n likeliest tokens, scattered back into vocabulary-sized rows for the verifier.
        vals, idx = torch.topk(logits.float(), n, dim=-1)
        small = saguaro_downweight(request_probs(vals[None], [seq.params])[0], top_f, self.config.saguaro_c)
        local = sample_from_probs(small, uniforms)
        toks = to_host(idx.gather(-1, local[:, None])[:, 0])
        q_prime = torch.zeros(logits.shape[0], vocab, device=logits.device).scatter_(-1, idx, small)
        return toks, q_prime

    def _forward(self, items: list[WorkItem]) -> torch.Tensor:
        return forward_items(self.runner, self.cache, items)

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

        def sample(idx: list[int], logits: torch.Tensor, width: int, depth: int):
            return [self._pick_rows(reqs[live[j]], logits[p, :width], [reqs[live[j]].seq.num_tokens + depth])
                    for p, j in enumerate(idx)]

        for i, tree in zip(live, draft_trees(self.runner, self.cache, rows, 1, sample)):
            r = reqs[i]
            r.num_computed = r.seq.num_tokens + r.k - 1  # the chain's K/V but its last token's (speculative)
            out[i] = Speculation(tree.token_ids, torch.stack(tree.q_rows) if tree.q_rows else None, source="jit")
        return out

    # ---- branch bundles -------------------------------------------------------------------------------------
    def build_bundles(self, reqs: list[DraftRequest], specs: list[Speculation]) -> list[BranchBundle]:
        """Glue forward, fork, and K batched tree-decode steps for every request (module docstring). A request
        whose K/V does not fit in the pool gets an empty bundle (its next round misses)."""
        fans = [self._fit_fanout(r, s) for r, s in zip(reqs, specs)]
        kept = [i for i, fan in enumerate(fans) if fan is not None]
        built = iter(self._build([reqs[i] for i in kept], [specs[i] for i in kept], [fans[i] for i in kept])
                     if kept else [])
        now = time.perf_counter()
        return [next(built) if fan is not None else BranchBundle(r.seq.request_id, r.round, list(s.token_ids), {},
                                                                 ready_at=now)
                for r, s, fan in zip(reqs, specs, fans)]

    def _fit_fanout(self, r: DraftRequest, s: Speculation) -> list[int] | None:
        """The fan-out for ``r`` with its slots reserved: the full one, else the trunk alone (no branches), else
        None when not even the glue fits."""
        fan = fanout_for(self.config.fanout, s.k, self.accept_rate, self.miss_exponent)
        n = r.seq.num_tokens
        if self._reserve(r, n + s.k + r.k * sum(fan)):
            return fan
        return [0] * len(fan) if self._reserve(r, n + s.k) else None

    def _build(self, reqs: list[DraftRequest], specs: list[Speculation], fans: list[list[int]]) -> list[BranchBundle]:
        glue_items = []
        for r, s in zip(reqs, specs):
            rid, n = r.seq.request_id, r.seq.num_tokens
            c = min(r.num_computed, n - 1)
            tokens = r.seq.token_ids[c:] + s.token_ids
            glue_items.append(WorkItem(self._slots(rid, 0, c), tokens, list(range(c, n + s.k)),
                                       self._slots(rid, c, n + s.k), len(tokens), [],
                                       list(range(n - 1 - c, len(tokens)))))
        glue_logits = self._forward(glue_items)
        branches: list[list[tuple[int, int]]] = []
        for i, (r, s, fan) in enumerate(zip(reqs, specs, fans)):
            r.num_computed = r.seq.num_tokens + s.k  # glue K/V valid through S (speculatively)
            roots = []
            r.candidates = {}
            rows = glue_logits[i, : s.k + 1].clone()
            if s.k:  # after a rejection at j the bonus is never S[j] (greedy), so it is not a candidate there
                drafted = to_device([list(range(s.k)), s.token_ids[: s.k]], rows.device, torch.long)
                rows[drafted[0], drafted[1]] = float("-inf")
            width = max(max(fan), min(MAX_RANK, rows.shape[-1] - 1))
            ranked_rows = to_host(torch.topk(rows, width, dim=-1).indices)  # one download per request
            for j, ranked in enumerate(ranked_rows):
                r.candidates[j] = ranked[:MAX_RANK]
                roots.extend((j, t) for t in ranked[: fan[j]])
            branches.append(roots)
        return self._decode_branches(reqs, specs, branches)

    def _decode_branches(self, reqs, specs, branches) -> list[BranchBundle]:
        now_tokens = [[c for _, c in br] for br in branches]
        out_tokens: list[list[list[int]]] = [[[] for _ in br] for br in branches]
        out_rows: list[list[list[torch.Tensor]]] = [[[] for _ in br] for br in branches]
        k_max = max((r.k for r in reqs), default=0)
        for step in range(k_max):
            items, live = [], []
            for i, (r, s, br) in enumerate(zip(reqs, specs, branches)):
                if step >= r.k or not br:
                    continue
                live.append(i)
                rid, n, m = r.seq.request_id, r.seq.num_tokens, len(br)
                base = n + s.k  # first scratch position (slots only; RoPE positions are the true ones)
                glue = self._slots(rid, n - 1, n + s.k)
                earlier = self._slots(rid, base, base + step * m)
                mask = torch.zeros(m, len(glue) + len(earlier), dtype=torch.bool)
                for b, (j, _) in enumerate(br):
                    mask[b, : j + 1] = True
                    mask[b, len(glue) + b :: m] = True
                items.append(WorkItem(self._slots(rid, 0, n - 1), [now_tokens[i][b] for b in range(m)],
                                      [n + j + step for j, _ in br], self._slots(rid, base + step * m,
                                                                                 base + (step + 1) * m),
                                      0, [-1] * m, list(range(m)), extra_slots=glue + earlier, extra_mask=mask))
            logits = self._forward(items)
            for j, i in enumerate(live):
                m = len(branches[i])
                n = reqs[i].seq.num_tokens  # branch (a, bonus) drafts from position n + a + 1 on
                toks, qs = self._pick_rows(reqs[i], logits[j, :m], [n + a + step + 1 for a, _ in branches[i]])
                for b, tok in enumerate(toks):
                    out_tokens[i][b].append(tok)
                    if qs is not None:
                        out_rows[i][b].append(qs[b])
                    now_tokens[i][b] = tok
        now = time.perf_counter()
        bundles = []
        for i, (r, br) in enumerate(zip(reqs, branches)):
            entries = {key: Speculation(out_tokens[i][b], torch.stack(out_rows[i][b]) if out_rows[i][b] else None)
                       for b, key in enumerate(br)} if not self.config.drop_cache else {}
            bundles.append(BranchBundle(r.seq.request_id, r.round, list(specs[i].token_ids), entries, ready_at=now))
        return bundles

    def observe(self, req: DraftRequest, num_accepted: int, k: int, bonus: int) -> None:
        """Feed the estimators with a real outcome of this drafter's own speculation."""
        if k > 0:
            self.acceptance.update(num_accepted, k)
        ranked = req.candidates.get(num_accepted)
        if ranked is not None:
            self.miss.update(ranked.index(bonus) + 1 if bonus in ranked else None)

    def refresh_estimates(self) -> None:
        self.accept_rate = self.acceptance.value
        self.miss_exponent = self.miss.r

    def commit_outcome(self, req: DraftRequest, accepted: list[int], bonus: int, own_speculation: bool) -> None:
        """Append the real outcome; keep the trunk K/V (prefix + accepted) and drop everything past it.

        If the verified speculation was not this drafter's (a backup's), the glue K/V past the old bonus belongs
        to other tokens and is dropped too.
        """
        n_before = req.seq.num_tokens
        valid = min(req.num_computed, n_before + (len(accepted) if own_speculation else 0))
        req.seq.output_ids.extend(accepted + [bonus])
        req.num_computed = valid
        if req.seq.request_id in self.blocks.tables:
            self.blocks.commit(req.seq.request_id, valid)
