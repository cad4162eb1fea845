"""Run-ahead drafting: SSD for a draft that costs a large share of a target step (``SSDConfig.strategy``).

Where one draft step costs a third of a target step or more, the drafter can pre-draft little more than one
chain within one verify, and a fan-out over outcomes (:mod:`drafter_service.ssd_drafter`) pays a glue forward
and K branch steps per round to build it. Run-ahead drafting bets on the likeliest outcome only, and deeper: the
drafter keeps one chain per request beyond the tokens it knows are committed, K/V at their true positions, and
drafts it one batched step at a time without waiting for the verifier, streaming each new token
(:class:`spec_core.speculation.ChainMsg`). The predicted outcome of a round is "everything accepted and the
bonus equal to the chain's next token": on a hit the next speculation is already drafted, and nothing is
re-run. On a miss the chain is cut where the outcome left it, the K/V past that point is dropped, and drafting
resumes from the committed tokens: no more than SD's serial draft.

Exactness does not depend on the chain: the verifier verifies whatever it takes from it with the usual test
(greedy: argmax; sampled: the q rows shipped with each token, drawn with uniforms keyed by position).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from drafter_service.core_borrowing import CoreBorrowing
from drafter_service.draft_request import drafter_params
from drafter_service.picking import pick_rows
from spec_core.backends import Backend
from spec_core.backends.default import as_backend
from spec_core.block_manager import BlockManager, NoFreeBlocks
from spec_core.config import SSDConfig
from spec_core.sequence import Sequence
from spec_core.speculation import ChainMsg, FreeEvent, OutcomeEvent, PrefillEvent, Speculation
from spec_core.tree_draft import DraftRow, draft_trees

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChainRequest:
    """The drafter's view of one request: committed tokens, the chain drafted past them, and K/V progress
    (positions below ``num_computed`` over ``seq.token_ids + chain`` have K/V; the chain's last token never does)."""

    seq: Sequence
    k: int
    chain: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)
    num_computed: int = 0
    #: The last outcome applied (-1: only the prompt), which every update it sends is tagged with.
    round: int = -1

    @property
    def tokens(self) -> list[int]:
        return self.seq.token_ids + self.chain


def reconcile(req: ChainRequest, new: list[int]) -> int:
    """Append the committed tokens ``new`` (accepted then bonus) to ``req`` and keep the chain past them where it
    predicted them all; otherwise cut it. Returns how many K/V positions stay valid."""
    n0 = req.seq.num_tokens
    m = 0
    while m < min(len(new), len(req.chain)) and req.chain[m] == new[m]:
        m += 1
    req.seq.output_ids.extend(new)
    if m == len(new):
        req.chain, req.q_rows = req.chain[m:], req.q_rows[m:]
    else:
        req.chain, req.q_rows = [], []
        req.num_computed = min(req.num_computed, n0 + m)
    return req.num_computed


class RunAheadDrafter:
    """Chains for many requests, one batched draft step at a time. Transport-free (see :class:`RunAheadLoop`)."""

    def __init__(self, draft: Backend, config: SSDConfig, alternate=None) -> None:
        """``alternate``: a shared flag (``.value``) that, while set, stops each chain at its K tokens
        (:mod:`spec_core.core_flags`); None: never."""
        self.alternate = alternate
        self.backend = as_backend(draft)  # the model, through the backend protocol only
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.cache = self.backend.new_paged_cache(config.num_blocks, config.block_size)
        self.requests: dict[str, ChainRequest] = {}
        #: Seconds spent in draft forwards so far (the drafter's busy time), and steps taken.
        self.busy_s = 0.0
        self.steps = 0
        #: Whether the last step fed one token per request (a pure decode step, whose time is comparable).
        self.last_step_decode = False
        self.out_of_blocks = 0
        #: Sampled chains draw from the plain q: Saguaro's down-weighting serves a fan-out this drafter has not.
        self._pick = replace(config, saguaro_c=1.0)

    def depth(self, req: ChainRequest) -> int:
        """How far past its committed tokens a request's chain may run: K while the sides take turns, else the
        configured depth (2K + 1 by default)."""
        if self.alternate is not None and self.alternate.value:
            return req.k
        return self.config.run_ahead_depth or 2 * req.k + 1

    # ---- events ---------------------------------------------------------------------------------------------
    def add(self, seq: Sequence, k: int) -> None:
        self.requests[seq.request_id] = ChainRequest(seq, min(k, self.config.k))

    def free(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.blocks.free(request_id)

    def apply(self, ev: OutcomeEvent) -> ChainMsg | None:
        """Apply an outcome; returns the whole chain left past the committed tokens (a sync for the verifier,
        whose view may lack its tail), or None when nothing is left."""
        req = self.requests.get(ev.request_id)
        if req is None:
            return None
        valid = reconcile(req, ev.accepted + [ev.bonus])
        if req.seq.request_id in self.blocks.tables:
            self.blocks.commit(req.seq.request_id, valid)
        req.round = ev.round
        req.k = min(ev.next_k, self.config.k)  # 0: plain rounds follow, nothing to draft until told otherwise
        return self._update(req, req.seq.num_tokens, len(req.chain)) if req.chain else None

    # ---- drafting -------------------------------------------------------------------------------------------
    def wanted(self) -> list[ChainRequest]:
        """Requests whose chain is shorter than its run-ahead depth."""
        return [r for r in self.requests.values() if r.k > 0 and len(r.chain) < self.depth(r)]

    def step(self) -> list[ChainMsg]:
        """One batched draft forward: one more chain token for every request that wants one and fits the pool."""
        reqs = [r for r in self.wanted() if self._reserve(r)]
        if not reqs:
            return []
        t0 = time.perf_counter()
        rows = [DraftRow(r.tokens, r.num_computed, 1,
                         lambda a, b, rid=r.seq.request_id: self.blocks.slots(rid, a, b)) for r in reqs]
        self.last_step_decode = all(len(row.token_ids) - row.num_computed == 1 for row in rows)

        def sample(idx: list[int], logits: torch.Tensor, width: int, depth: int):
            out = []
            for p, i in enumerate(idx):
                toks, q, _ = pick_rows(self._pick, reqs[i].seq, logits[p, :1], [len(rows[i].token_ids)], 1)
                out.append((toks, q))
            return out

        trees = draft_trees(self.backend, self.cache, rows, 1, sample)
        self.busy_s += time.perf_counter() - t0
        self.steps += 1
        updates = []
        for r, row, tree in zip(reqs, rows, trees):
            r.num_computed = len(row.token_ids)
            r.chain.append(tree.token_ids[0])
            if tree.q_rows:
                r.q_rows.append(tree.q_rows[0])
            updates.append(self._update(r, len(row.token_ids), 1))
        return updates

    def _reserve(self, req: ChainRequest) -> bool:
        try:
            self.blocks.ensure(req.seq.request_id, len(req.tokens) + 1)
            return True
        except NoFreeBlocks:
            self.out_of_blocks += 1
            return False

    def _update(self, req: ChainRequest, start: int, count: int) -> ChainMsg:
        """The chain's last ``count`` tokens, from absolute position ``start``."""
        toks = req.chain[len(req.chain) - count:]
        q = torch.stack(req.q_rows[len(req.q_rows) - count:]) if req.q_rows else None
        return ChainMsg(req.seq.request_id, req.round, start, Speculation(toks, q, source="chain"), self.busy_s)


class RunAheadLoop:
    """The drafter's event loop for run-ahead drafting, over any drafter link end (the pipe, the gRPC stream):
    apply every event that has arrived, then draft one step; block on the link only when no chain wants a token."""

    def __init__(self, drafter: RunAheadDrafter, link, borrowing: CoreBorrowing | None = None, idle=None) -> None:
        """``borrowing``: run draft steps on the verifier's core too while it waits (:mod:`core_borrowing`).
        ``idle``: a shared flag (``.value``) held set while this loop blocks with nothing to draft, so that the
        verifier may run on this core (:mod:`spec_core.core_flags`); None: none."""
        self.drafter = drafter
        self.link = link
        self.borrowing = borrowing
        self.idle = idle
        self.running = True

    def handle(self, events: list[object]) -> None:
        for ev in events:
            if isinstance(ev, PrefillEvent):
                self.drafter.add(Sequence(ev.request_id, list(ev.token_ids), drafter_params(ev.params)), ev.k)
            elif isinstance(ev, FreeEvent):
                self.drafter.free(ev.request_id)
            elif isinstance(ev, OutcomeEvent):
                sync = self.drafter.apply(ev)
                if sync is not None:
                    self.link.send(sync)
            elif ev == "stop":
                self.running = False

    def run(self) -> None:
        """Serve until "stop", or until the verifier's end of the link is gone."""
        while self.running:
            events = []
            try:
                if not self.drafter.wanted():
                    events.append(self._recv_idle())
                while self.link.poll(0):
                    events.append(self.link.recv())
            except EOFError:
                return
            self.handle(events)
            if self.borrowing is not None:
                self.borrowing.before_step()
            t0 = time.perf_counter()
            updates = self.drafter.step()
            if self.borrowing is not None and updates and self.drafter.last_step_decode:
                self.borrowing.observe(time.perf_counter() - t0)
            if self.idle is not None and not self.drafter.wanted():
                self.idle.value = 1  # up before the last update goes: the verify it completes may take this core
            for update in updates:
                self.link.send(update)
            self.link.flush()

    def _recv_idle(self) -> object:
        """Block for the next event with the idle flag up (raised already where the last step completed every
        chain), dropped once an event arrives."""
        if self.idle is None:
            return self.link.recv()
        self.idle.value = 1
        try:
            return self.link.recv()
        finally:
            self.idle.value = 0
