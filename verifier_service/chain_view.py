"""The verifier's copy of a run-ahead drafter's chain for one request (:mod:`drafter_service.run_ahead`).

The view holds the chain's tokens (and q rows, sampled) from the request's committed length ``base`` on. Chain
updates arrive in the drafter's order; each says from which absolute position it continues and which outcome the
drafter had applied when it drafted it.

Invariant: the view is always a prefix of the drafter's chain as it continues the committed tokens, so every token
a round takes from it was drafted from exactly the committed prefix. It holds because:
  * on an outcome the view keeps its tail only where it predicted every committed token (the drafter then keeps
    its chain too); otherwise it empties and ignores updates drafted before the drafter applied that outcome
    (``need_round``), which the drafter follows with a sync: its whole chain past the committed tokens;
  * an update that would leave a gap (one before it was ignored) or that contradicts committed tokens is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spec_core.speculation import ChainMsg

#: Committed tokens kept to check updates that start before the view's base (drafted before the last outcomes).
TAIL = 64


@dataclass(slots=True)
class ChainView:
    base: int
    need_round: int = -1
    tokens: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)
    #: The drafter's reported forward seconds, at its latest update.
    busy_s: float = 0.0

    def take(self, msg: ChainMsg) -> bool:
        """Apply one update; whether it was used."""
        if msg.round < self.need_round:
            return False
        toks, start = list(msg.speculation.token_ids), msg.start
        q = list(msg.speculation.draft_probs.unbind(0)) if msg.speculation.draft_probs is not None else []
        self.busy_s = max(self.busy_s, msg.busy_s)
        if start < self.base:  # it began before the last outcomes: its head must be what they committed
            over = self.base - start
            if over > len(self.tail) or toks[:over] != self.tail[len(self.tail) - over:]:
                return False
            toks, q, start = toks[over:], q[over:], self.base
        cut = start - self.base
        if cut > len(self.tokens):
            return False
        self.tokens = self.tokens[:cut] + toks
        self.q_rows = self.q_rows[:cut] + q if q else []
        return True

    def commit(self, round_: int, new: list[int]) -> bool:
        """The outcome of ``round_`` committed ``new``; whether the view predicted all of it (and keeps its tail)."""
        m = len(new)
        kept = self.tokens[:m] == new
        if kept:
            self.tokens, self.q_rows = self.tokens[m:], self.q_rows[m:]
        else:
            self.tokens, self.q_rows, self.need_round = [], [], round_
        self.base += m
        self.tail = (self.tail + new)[-TAIL:]
        return kept

    def take_speculation(self, k: int) -> tuple[list[int], torch.Tensor | None]:
        """The first ``k`` tokens of the view (fewer where it is shorter) and their q rows (None: greedy)."""
        toks = self.tokens[:k]
        q = torch.stack(self.q_rows[: len(toks)]) if self.q_rows and toks else None
        return toks, q
