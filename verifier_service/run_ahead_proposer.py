"""The verifier's side of run-ahead drafting (:mod:`drafter_service.run_ahead`): each round takes its speculation
from the request's chain view (:class:`verifier_service.chain_view.ChainView`).

A round is a **hit** when the view already holds the round's K tokens as the step starts: the drafter ran ahead of
the verifier. Where it holds fewer, the verifier waits for the drafter, which is drafting exactly those tokens,
while it makes progress (``stall_s`` without an update ends the wait) and for at most ``max_wait_s``; then it
verifies what the view has (the n-gram backup where it has nothing). In this regime the verifier would otherwise
idle: the draft is the slower side. A seeded sampled request (``Sequence.reproducible``) always waits for its K
tokens, so its speculations, and so its tokens, never depend on timing.
"""

from __future__ import annotations

import time
from dataclasses import replace

from spec_core.core_flags import CoreFlags
from spec_core.sequence import Sequence
from spec_core.speculation import ChainMsg, PrefillEvent, Speculation
from spec_core.transfer import to_device
from spec_core.tree import TokenTree
from verifier_service.chain_view import TAIL, ChainView
from verifier_service.run_ahead_schedule import PIPELINED, RunAheadSchedule
from verifier_service.ssd_proposer import REPRODUCIBLE_WAIT_S, SSDProposer
from verifier_service.ssd_request import SSDRequestState

#: A wait for the drafter ends once it has sent nothing for this long (it is stuck on a long prompt, or out of
#: KV blocks), and in any case after ``MAX_WAIT_VERIFIES`` verify times (at least ``MIN_MAX_WAIT_S``).
STALL_S = 0.25
MAX_WAIT_VERIFIES = 4.0
MIN_MAX_WAIT_S = 0.5


class RunAheadProposer(SSDProposer):
    """:class:`SSDProposer` over chain updates instead of branch bundles (same link, stats and backup)."""

    def __init__(self, *args, flags: CoreFlags | None = None, schedule: RunAheadSchedule | None = None,
                 **kwargs) -> None:
        """``flags``: the cores' shared flags with a local drafter process (:mod:`spec_core.core_flags`): this side
        holds ``waiting`` set while it waits for the drafter, reads ``idle`` and sets ``alternate`` from
        ``schedule`` (:mod:`verifier_service.run_ahead_schedule`); None: neither side lends its core."""
        super().__init__(*args, **kwargs)
        self.flags = flags
        self.schedule = schedule or RunAheadSchedule(mode=PIPELINED)
        if flags is not None:  # from the first round on, the drafter drafts as the schedule says
            flags.alternate.value = int(self.schedule.alternating)
        #: When the last speculating round was proposed, and its batch size (None: the last step did not speculate).
        self._round_start: tuple[float, int] | None = None
        self.views: dict[str, ChainView] = {}
        #: The drafter's forward seconds, as its latest update reported them.
        self.drafter_busy_s = 0.0
        self._last_update = time.perf_counter()

    def _take(self, msg: object) -> None:
        if not isinstance(msg, ChainMsg):
            super()._take(msg)
            return
        self.stats.jit_received += 1
        self.drafter_busy_s = max(self.drafter_busy_s, msg.busy_s)
        self._last_update = time.perf_counter()
        view = self.views.get(msg.request_id)
        if view is not None:
            view.take(msg)

    def propose(self, seqs: list[Sequence], ks: list[int], quiet: bool = False) -> list[TokenTree]:
        if self.pending_link is not None:
            link, self.pending_link = self.pending_link, None
            self.replace_link(link)
        self._drain()
        self._time_round(len(seqs) if seqs and all(k > 0 for k in ks) else 0)
        self.cold_wait_s = 0.0
        live = []
        for seq, k in zip(seqs, ks):
            st = self.state.get(seq.request_id)
            if st is None and not (quiet and k == 0):
                self._start(seq, k)
            elif st is not None and k > 0 and st.deferred:
                self._send_deferred(seq, st, k)
            if st is not None and k > 0:
                live.append((seq, k))
        ready = {seq.request_id: len(self.views[seq.request_id].tokens) >= k for seq, k in live}
        waited = self._await_chains(live) if not all(ready.values()) else 0.0
        trees = []
        for seq, k in zip(seqs, ks):
            st = self.state.get(seq.request_id)
            spec = None
            if st is not None and st.round > 0 and k > 0:
                toks, q = self.views[seq.request_id].take_speculation(k)
                spec = Speculation(toks, q, source="chain") if toks else None
                st.used_hit = ready[seq.request_id]
                st.source = "hit" if st.used_hit else ("jit" if spec is not None else "backup")
                st.miss_kind = "late" if spec is not None else "no_bundle"
                if st.used_hit:
                    st.warm = True
                    self.stats.count_hit(len(toks), len(toks))
                elif waited:
                    st.jit_attempted = True
                    self.stats.jit += int(spec is not None)
            tree = self._to_tree(seq, k, spec)
            trees.append(self._with_tail(seq, tree) if spec is not None else tree)
        self.link.flush()
        return trees

    def drafter_idle(self) -> bool:
        """Whether the drafter process has nothing to draft now, so that a verify may run on its core too."""
        return self.flags is not None and bool(self.flags.idle.value)

    def _time_round(self, batch: int) -> None:
        """The last round's time for the schedule (proposal to proposal), and this one's start (``batch``: its
        speculating requests, 0 where some request decodes plain)."""
        now = time.perf_counter()
        if self._round_start is not None:
            t0, b = self._round_start
            self.schedule.observe(b, now - t0)
            if self.flags is not None:
                self.flags.alternate.value = int(self.schedule.alternating)
        self._round_start = (now, batch) if batch else None

    def _with_tail(self, seq: Sequence, tree: TokenTree) -> TokenTree:
        """A sampled request's chain with the view's next token as its tail (:attr:`TokenTree.tail`): then the
        round's last token keeps the chain going as often as the target's test accepts it."""
        view = self.views[seq.request_id]
        m = tree.num_nodes
        if seq.params.deterministic or len(view.tokens) <= m or len(view.q_rows) <= m:
            return tree
        return replace(tree, tail=(view.tokens[m], to_device(view.q_rows[m], self.device)))

    def _start(self, seq: Sequence, k: int) -> None:
        """A request's first round (the target's prefill): the drafter starts its chain from the prompt."""
        self.state[seq.request_id] = SSDRequestState(asked={0} if k > 0 else set())
        self.views[seq.request_id] = ChainView(base=len(seq.token_ids), tail=list(seq.token_ids[-TAIL:]))
        self.link.send(PrefillEvent(seq.request_id, seq.token_ids, seq.params, k))

    def _await_chains(self, live: list[tuple[Sequence, int]]) -> float:
        """Wait for the drafter to bring every speculating request's view to its K tokens (module docstring)."""
        if not self.link.alive:
            return 0.0
        t0 = now = time.perf_counter()
        cap = t0 + max(MIN_MAX_WAIT_S, MAX_WAIT_VERIFIES * self.verify_s_ema)
        must_cap = t0 + REPRODUCIBLE_WAIT_S
        short = [(s, k) for s, k in live if len(self.views[s.request_id].tokens) < k]
        cold = all(not self.state[s.request_id].warm for s, _ in short)
        self._last_update = max(self._last_update, t0)

        def waiting() -> bool:
            if not (short and self.link.alive):
                return False
            if any(s.reproducible for s, _ in short):  # its tokens must not depend on timing: always K
                return now < must_cap
            return now < cap and now - self._last_update < STALL_S

        if self.flags is not None:
            self.flags.waiting.value = 1
        try:
            while waiting():
                self._drain(timeout=max(0.0, min(cap - now, STALL_S - (now - self._last_update), 0.05)))
                short = [(s, k) for s, k in short if len(self.views[s.request_id].tokens) < k]
                now = time.perf_counter()
        finally:
            if self.flags is not None:
                self.flags.waiting.value = 0
        waited = now - t0
        self.stats.jit_wait_s += self._count_wait(waited, cold)
        return waited

    def commit(self, seq: Sequence, n: int, tree: TokenTree, path: list[int], next_k: int) -> None:
        st = self.state.get(seq.request_id)
        round_ = st.round if st is not None else None
        super().commit(seq, n, tree, path, next_k)
        view = self.views.get(seq.request_id)
        if view is not None and round_ is not None:
            view.commit(round_, seq.token_ids[n: n + len(path) + 1])

    def replace_link(self, link) -> None:
        super().replace_link(link)
        self.views.clear()

    def release(self, seq: Sequence) -> None:
        self.views.pop(seq.request_id, None)
        self._round_start = None  # the next round's time is not this request's last step
        super().release(seq)
