"""The verifier's side of SSD: speculations from the asynchronous drafter, held locally so a hit costs nothing.

For each request the verifier keeps the newest branch bundle the drafter sent. When round R's outcome is known:
  * **hit**: the bundle for round R arrived before round R's verification returned and has the outcome's key
    (k, bonus): that branch is S_{R+1}, with no round trip;
  * **miss**: the drafter (told the outcome at once) drafts S_{R+1} just in time; the verifier waits for it at most
    ``wait_fraction`` × a verify time, then falls back to the n-gram backup (or no speculation). A bundle that
    arrives late is still used, but counts as a miss. The drafter never stalls the verifier past that deadline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from spec_core.ngram import backup_tokens, one_hot_rows
from spec_core.sequence import Sequence
from spec_core.speculation import (
    BranchBundle,
    FreeEvent,
    OutcomeEvent,
    PrefillEvent,
    Speculation,
    SpeculationMsg,
)
from spec_core.tree import TokenTree

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SSDStats:
    rounds: int = 0
    hits: int = 0
    jit: int = 0
    backup: int = 0
    wait_s: float = 0.0
    tokens_on_hit: int = 0
    tokens_on_miss: int = 0
    hit_rounds: int = 0

    @property
    def cache_hit_rate(self) -> float | None:
        return self.hits / self.rounds if self.rounds else None


@dataclass(slots=True)
class _ReqState:
    round: int = 0
    verified: list[int] = field(default_factory=list)
    last_key: tuple[int, int] | None = None
    verify_end: float = 0.0
    used_hit: bool = False
    bundles: dict[int, BranchBundle] = field(default_factory=dict)
    jit: dict[int, Speculation] = field(default_factory=dict)


class SSDProposer:
    """Implements the engine's proposer interface (``propose``, ``commit``, ``release``) over a drafter link."""

    def __init__(self, link, vocab_size: int, backup: str = "ngram", wait_fraction: float = 0.5,
                 backup_greedy_match: bool = False) -> None:
        """``backup_greedy_match`` is a NEGATIVE CONTROL ONLY (biased greedy-match verification of backups)."""
        if backup not in ("ngram", "none"):
            raise ValueError(f"backup must be 'ngram' or 'none', got {backup!r}")
        self.link = link
        self.vocab_size = vocab_size
        self.backup = backup
        self.wait_fraction = wait_fraction
        self.backup_greedy_match = backup_greedy_match
        self.state: dict[str, _ReqState] = {}
        self.stats = SSDStats()
        self.verify_s_ema = 0.01

    # ---- messages -------------------------------------------------------------------------------------------
    def _take(self, msg: object) -> None:
        if isinstance(msg, BranchBundle):
            st = self.state.get(msg.request_id)
            if st is not None:
                st.bundles[msg.round] = msg
                for old in [r for r in st.bundles if r < msg.round - 1]:
                    del st.bundles[old]
        elif isinstance(msg, SpeculationMsg):
            st = self.state.get(msg.request_id)
            if st is not None and msg.round >= st.round:
                st.jit[msg.round] = msg.speculation

    def _drain(self, timeout: float = 0.0) -> bool:
        got = False
        while self.link.poll(timeout):
            self._take(self.link.recv())
            got, timeout = True, 0.0
        return got

    def _lookup(self, st: _ReqState) -> tuple[Speculation | None, bool]:
        """(speculation for st.round, counts as hit) if the drafter has provided one."""
        b = st.bundles.get(st.round - 1)
        if b is not None and b.base_tokens == st.verified and st.last_key in b.entries:
            return b.entries[st.last_key], b.ready_at <= st.verify_end
        for old in [r for r in st.jit if r < st.round]:
            del st.jit[old]
        return st.jit.get(st.round), False

    # ---- proposer interface ---------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[TokenTree]:
        self._drain()
        specs: dict[str, Speculation | None] = {}
        waiting = []
        for seq, k in zip(seqs, ks):
            st = self.state.get(seq.request_id)
            if st is None:  # first round: the drafter catches up on the prompt while the target prefills
                self.state[seq.request_id] = _ReqState()
                self.link.send(PrefillEvent(seq.request_id, seq.token_ids, seq.params, k))
                specs[seq.request_id] = None
                continue
            spec, hit = self._lookup(st)
            if spec is None and k > 0:
                waiting.append(seq)
            specs[seq.request_id] = spec
            st.used_hit = hit
        if waiting and getattr(self.link, "alive", True):  # a dead drafter link: straight to the backup
            deadline = time.perf_counter() + self.wait_fraction * self.verify_s_ema
            t0 = time.perf_counter()
            while waiting and time.perf_counter() < deadline:
                self._drain(timeout=max(0.0, deadline - time.perf_counter()))
                still = []
                for seq in waiting:
                    spec, _ = self._lookup(self.state[seq.request_id])
                    if spec is None:
                        still.append(seq)
                    else:
                        specs[seq.request_id] = spec
                        self.stats.jit += 1
                waiting = still
            self.stats.wait_s += time.perf_counter() - t0
        trees = [self._to_tree(seq, k, specs[seq.request_id]) for seq, k in zip(seqs, ks)]
        flush = getattr(self.link, "flush", None)
        if flush is not None:  # transports that batch sends deliver them now, before the verify
            flush()
        return trees

    def _to_tree(self, seq: Sequence, k: int, spec: Speculation | None) -> TokenTree:
        st = self.state[seq.request_id]
        if st.round > 0 and k > 0:
            self.stats.rounds += 1
            self.stats.hits += int(st.used_hit)
        if spec is not None and k > 0:
            tokens = spec.token_ids[:k]
            probs = spec.draft_probs[:k] if spec.draft_probs is not None else None
            st.verified = list(tokens)
            return TokenTree.chain(tokens, probs)
        tokens = backup_tokens(seq.token_ids, k, self.backup) if k > 0 and st.round > 0 else []
        st.verified = list(tokens)
        if not tokens:
            return TokenTree(parents=[], token_ids=[], draft_probs=None)
        self.stats.backup += 1
        if self.backup_greedy_match and not seq.params.greedy:
            return TokenTree(list(range(-1, len(tokens) - 1)), tokens, None, greedy_match=True)
        return TokenTree.chain(tokens, None if seq.params.greedy else one_hot_rows(tokens, self.vocab_size))

    def commit(self, seq: Sequence, n: int, tree: TokenTree, path: list[int], next_k: int) -> None:
        """Tell the drafter the outcome of this round right away (it starts the next bundle on it)."""
        st = self.state[seq.request_id]
        now = time.perf_counter()
        st.verify_end = now
        accepted = [tree.token_ids[i] for i in path]
        if st.round > 0 and tree.num_nodes:
            tokens = len(accepted) + 1
            if st.used_hit:
                self.stats.hit_rounds += 1
                self.stats.tokens_on_hit += tokens
            else:
                self.stats.tokens_on_miss += tokens
        if not seq.finished and len(seq.token_ids) > n + len(path):
            bonus = seq.token_ids[n + len(path)]
            self.link.send(OutcomeEvent(seq.request_id, st.round, list(st.verified), len(accepted), bonus, next_k,
                                        verify_s=self.verify_s_ema, sent_at=now))
            st.last_key = (len(accepted), bonus)
        st.round += 1

    def observe_verify_time(self, seconds: float) -> None:
        self.verify_s_ema = 0.8 * self.verify_s_ema + 0.2 * seconds

    def release(self, seq: Sequence) -> None:
        if self.state.pop(seq.request_id, None) is not None:
            self.link.send(FreeEvent(seq.request_id))
