"""The verifier's side of SSD: speculations from the asynchronous drafter, held locally so a hit costs nothing.

For each request the verifier keeps the newest branch bundle the drafter sent. When round R's outcome is known:
  * **hit**: the bundle for round R arrived before round R's verification returned and has the outcome's key
    (k, bonus): that branch is S_{R+1}, with no round trip;
  * **miss**: the drafter (told the outcome at once) drafts S_{R+1} just in time; the verifier waits for it at most
    ``wait_fraction`` × a verify time, then falls back to the n-gram backup (or no speculation). A bundle that
    arrives late is still used, but counts as a miss. The drafter never stalls the verifier past that deadline.
    Where the backup policy chose the n-gram backup at once (no just-in-time draft), a round whose bundle the
    drafter is still building waits for it as long as that pays, by how late such bundles have been and how many
    more tokens a bundle's round makes (:func:`verifier_service.ssd_stats.bundle_wait`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import replace

import torch

from spec_core.estimators import VerifyCosts
from spec_core.ngram import backup_tokens, one_hot_rows
from spec_core.sequence import Sequence
from spec_core.speculation import (
    BranchBundle,
    DrafterLink,
    FreeEvent,
    OutcomeEvent,
    PrefillEvent,
    Speculation,
    SpeculationMsg,
    spine_length,
)
from spec_core.transfer import to_device
from spec_core.tree import TokenTree
from verifier_service.ssd_request import SSDRequestState
from verifier_service.ssd_stats import SSDStats, bundle_gain, bundle_wait

logger = logging.getLogger(__name__)


#: The longest a seeded sampled request waits for its just-in-time draft before the backup serves it.
REPRODUCIBLE_WAIT_S = 30.0


class SSDProposer:
    """Implements the engine's proposer interface (``propose``, ``commit``, ``release``) over a drafter link."""

    def __init__(self, link: DrafterLink, vocab_size: int, backup: str = "ngram", wait_fraction: float = 0.5,
                 backup_policy: str = "auto",
                 device: torch.device | str = "cpu", max_nodes: int | None = None) -> None:
        """``backup_policy``: on a miss, ``neural`` waits for a just-in-time draft (up to ``wait_fraction`` of a
        verify), ``fast`` uses the n-gram backup at once, ``auto`` picks per step by batch size from measured
        timings (the paper's b*, :func:`spec_core.policy.choose_backup`). ``device``: the target's, where the q rows
        of sampled speculations (decoded on the host by the codec) are moved, one upload per speculation.
        ``max_nodes``: the most tree nodes the engine reserves per request and round; a larger candidate tree
        loses its last nodes (leaves)."""
        self.max_nodes = max_nodes
        self._warned_cap = False
        if backup not in ("ngram", "none"):
            raise ValueError(f"backup must be 'ngram' or 'none', got {backup!r}")
        if backup_policy not in ("auto", "neural", "fast"):
            raise ValueError(f"backup_policy must be auto, neural or fast, got {backup_policy!r}")
        self.backup_policy = backup_policy
        self.jit_allowed = backup_policy != "fast"
        self.reconnects = 0
        self._policy_steps = 0
        #: Rounds between noticing a dead drafter link and the first round served by the backup (fault metric).
        self.down_at_round: int | None = None
        self.switch_rounds: int | None = None
        self.link = link
        #: A new link to switch to at the start of the next step (set by a watcher thread that restarted the
        #: drafter; :meth:`replace_link` runs on the engine's thread).
        self.pending_link = None
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.backup = backup
        self.wait_fraction = wait_fraction
        self.state: dict[str, SSDRequestState] = {}
        self.stats = SSDStats()
        self.verify_s_ema = 0.01
        #: How long after their verify ended recent overdue bundles became ready (``inf``: never), for the wait.
        self.lateness: deque[float] = deque(maxlen=64)
        self.verify_costs = VerifyCosts()  # for the drafter's tree sizing, sent with each outcome
        #: Seconds the last :meth:`propose` waited for requests none of which could have hit
        #: (:meth:`SSDRequestState.cold`); the planner's cost fit leaves them out (:mod:`verifier_service.adaptive`).
        self.cold_wait_s = 0.0

    # ---- messages -------------------------------------------------------------------------------------------
    def _take(self, msg: object) -> None:
        if isinstance(msg, BranchBundle):
            self.stats.bundles_received += 1
            self.stats.branches_received += len(msg.entries)
            st = self.state.get(msg.request_id)
            if st is not None:
                st.bundles[msg.round] = msg
                if msg.round in st.due:
                    self.lateness.append(msg.ready_at - st.due.pop(msg.round))
                for old in [r for r in st.bundles if r < msg.round - 1]:
                    del st.bundles[old]
        elif isinstance(msg, SpeculationMsg):
            self.stats.jit_received += 1
            st = self.state.get(msg.request_id)
            if st is not None and msg.round >= st.round:
                st.jit[msg.round] = msg.speculation

    def _drain(self, timeout: float = 0.0) -> bool:
        got = False
        while self.link.poll(timeout):
            self._take(self.link.recv())
            got, timeout = True, 0.0
        return got

    def _lookup(self, st: SSDRequestState) -> tuple[Speculation | None, bool]:
        """(speculation for st.round, counts as hit) if the drafter has provided one."""
        b = st.bundles.get(st.round - 1)
        if b is not None and b.base_tokens == st.verified and b.base_parents == st.verified_parents:
            if st.last_key in b.entries:
                hit = b.ready_at <= st.verify_end
                if not hit:
                    st.miss_kind = "late"
                return b.entries[st.last_key], hit
            st.miss_kind = "unpredicted"
        elif b is not None:
            st.miss_kind = "other_base"
        for old in [r for r in st.jit if r < st.round]:
            del st.jit[old]
        return st.jit.get(st.round), False

    # ---- proposer interface ---------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], ks: list[int], quiet: bool = False) -> list[TokenTree]:
        """One tree per request (empty where K = 0 or nothing came). ``quiet``: the step runs on the drafter's
        core (:mod:`verifier_service.core_lending`), so a new request planned plain tells the drafter nothing yet;
        its prompt goes with the first round that speculates."""
        if self.pending_link is not None:
            link, self.pending_link = self.pending_link, None
            self.replace_link(link)
        self._drain()
        self.cold_wait_s = 0.0
        specs: dict[str, Speculation | None] = {}
        waiting = []
        if any(ks):  # a step that speculates chooses its backup; a plain one keeps the last choice (nothing drafts)
            self.jit_allowed = self.choose_backup(len(seqs)) == "neural"
            self.stats.fast_backup_steps += int(not self.jit_allowed)
        for seq, k in zip(seqs, ks):
            st = self.state.get(seq.request_id)
            if st is None and quiet and k == 0:
                specs[seq.request_id] = None
                continue
            if st is None:  # first round: the drafter catches up on the prompt while the target prefills
                self.state[seq.request_id] = SSDRequestState(asked={0} if k > 0 else set())  # round 0's bundle
                # a coupled request's drafter races with this side's seed (spec_core.coupling)
                params = replace(seq.params, seed=seq.seed) if seq.params.coupled else seq.params
                self.link.send(PrefillEvent(seq.request_id, seq.token_ids, params, k))
                specs[seq.request_id] = None
                continue
            st.miss_kind = "no_bundle"
            if k > 0 and st.deferred:  # plain rounds the drafter has not heard of: it needs them to draft this one
                self._send_deferred(seq, st, k)
            spec, hit = self._lookup(st)
            if hit and k > 0:
                self.stats.count_hit(st.last_key[0], spine_length(st.verified_parents, len(st.verified)))
                st.warm = True
            if spec is None and k > 0 and (st.draft_can_come() or seq.reproducible):
                waiting.append(seq)
            specs[seq.request_id] = spec
            st.used_hit = hit
            st.source = "hit" if hit else ("jit" if spec is not None else "backup")
        alive = self.link.alive
        if not alive and self.down_at_round is None:
            self.down_at_round, self.switch_rounds = self.stats.rounds, None
        elif alive:
            self.down_at_round = None
        if waiting and (self.jit_allowed or any(s.reproducible for s in waiting)) and self.link.alive:
            for seq in waiting:
                self.state[seq.request_id].jit_attempted = True
            cold = all(self.state[s.request_id].cold() for s in waiting)
            t0 = time.perf_counter()
            deadline = t0 + (self.wait_fraction * self.verify_s_ema if self.jit_allowed else 0.0)
            while waiting and time.perf_counter() < deadline:
                self._drain(timeout=max(0.0, deadline - time.perf_counter()))
                waiting = [seq for seq in waiting if not self._take_jit(seq, specs)]
            self._await_reproducible(waiting, specs)
            self.stats.jit_wait_s += self._count_wait(time.perf_counter() - t0, cold)
        elif waiting and self.link.alive:
            self._await_bundles(waiting, specs, len(seqs))
        trees = [self._to_tree(seq, k, specs[seq.request_id]) for seq, k in zip(seqs, ks)]
        self.link.flush()  # transports that batch sends deliver them now, before the verify
        return trees

    def _await_reproducible(self, waiting: list[Sequence], specs: dict) -> None:
        """Seeded sampled requests (``Sequence.reproducible``) wait for their just-in-time draft past the deadline
        (up to ``REPRODUCIBLE_WAIT_S``, while the link lives): an n-gram backup would change their tokens."""
        deadline = time.perf_counter() + REPRODUCIBLE_WAIT_S
        must = [s for s in waiting if s.reproducible]
        while must and self.link.alive and time.perf_counter() < deadline:
            self._drain(timeout=0.05)
            must = [seq for seq in must if not self._take_jit(seq, specs)]

    def _await_bundles(self, waiting: list[Sequence], specs: dict, batch: int) -> None:
        """The fast backup's short wait (module docstring) for the bundles of ``waiting`` still being built."""
        due = [s for s in waiting if self._overdue(self.state[s.request_id])]
        wait = bundle_wait(self.lateness, bundle_gain(self.stats), self.verify_s_ema,
                           self.wait_fraction * self.verify_s_ema, len(due) / batch) if due else 0.0
        if wait <= 0:
            return
        cold = all(self.state[s.request_id].cold() for s in due)
        t0 = time.perf_counter()
        self.stats.bundle_wait_attempts += len(due)
        while due and time.perf_counter() < t0 + wait:
            self._drain(timeout=max(0.0, t0 + wait - time.perf_counter()))
            due = [seq for seq in due if not self._take_late_bundle(seq, specs)]
        self.stats.bundle_wait_s += self._count_wait(time.perf_counter() - t0, cold)

    def _count_wait(self, waited: float, cold: bool) -> float:
        """Count a wait of ``waited`` seconds in the totals every wait shares, and in :attr:`cold_wait_s` if none of
        the requests it waited for could have hit; returns it for the caller's own kind of wait."""
        self.cold_wait_s += waited if cold else 0.0
        self.stats.wait_s += waited
        self.stats.max_wait_s = max(self.stats.max_wait_s, waited)
        return waited

    def _overdue(self, st: SSDRequestState) -> bool:
        """Whether the bundle this round looks up was asked for and has not come: then note when it was due (and
        count the ones overdue for rounds long past as never coming)."""
        for r in [r for r in st.due if r < st.round - 3]:
            del st.due[r]
            self.lateness.append(math.inf)
        if st.round - 1 not in st.asked:
            return False
        st.due.setdefault(st.round - 1, st.verify_end)
        return True

    def _take_late_bundle(self, seq: Sequence, specs: dict) -> bool:
        st = self.state[seq.request_id]
        spec, _ = self._lookup(st)
        if spec is None:
            return False
        specs[seq.request_id], st.source = spec, "late_bundle"
        return True

    def _take_jit(self, seq: Sequence, specs: dict) -> bool:
        """Put ``seq``'s speculation in ``specs`` if the drafter has delivered it since the step began."""
        spec, _ = self._lookup(self.state[seq.request_id])
        if spec is None:
            return False
        specs[seq.request_id] = spec
        self.stats.jit += 1
        self.state[seq.request_id].source = "jit"
        return True

    def _to_tree(self, seq: Sequence, k: int, spec: Speculation | None) -> TokenTree:
        st = self.state.get(seq.request_id)
        if st is None:  # held back by a quiet step: plain
            return TokenTree(parents=[], token_ids=[], draft_probs=None)
        st.speculating = st.round > 0 and k > 0
        if st.speculating:
            self.stats.rounds += 1
            self.stats.hits += int(st.used_hit)
            if not st.used_hit:
                kind = f"misses_{st.miss_kind}"
                setattr(self.stats, kind, getattr(self.stats, kind) + 1)
                if spec is not None:
                    self.stats.jit_misses += 1
                else:
                    self.stats.backup_misses += 1
        if spec is not None and k > 0:
            if self.max_nodes is not None and spec.num_nodes > self.max_nodes and not self._warned_cap:
                self._warned_cap = True
                logger.warning("the drafter sent a %d-node tree; this verifier reserves %d per round, so trees lose "
                               "their last leaves and miss (check that both ends use the same --tree)",
                               spec.num_nodes, self.max_nodes)
            spec = spec.truncated(k, self.max_nodes)
            probs = to_device(spec.draft_probs, self.device) if spec.draft_probs is not None else None
            st.verified, st.verified_parents, st.verified_lookup = list(spec.token_ids), spec.parents, spec.lookup_from
            return TokenTree(spec.tree_parents, list(spec.token_ids), probs)
        tokens = backup_tokens(seq.token_ids, k, self.backup) if k > 0 and st.round > 0 else []
        st.verified, st.verified_parents, st.verified_lookup = list(tokens), None, None
        if self.down_at_round is not None and self.switch_rounds is None and k > 0 and st.round > 0:
            self.switch_rounds = self.stats.rounds - 1 - self.down_at_round  # rounds served otherwise first
        if not tokens:
            return TokenTree(parents=[], token_ids=[], draft_probs=None)
        self.stats.backup += 1
        return self._backup_tree(seq, tokens)

    def _backup_tree(self, seq: Sequence, tokens: list[int]) -> TokenTree:
        """A backup chain: a sampled request's proposal is a point mass on each token (one-hot q rows)."""
        return TokenTree.chain(tokens, None if seq.params.deterministic
                               else one_hot_rows(tokens, self.vocab_size, self.device))

    def commit(self, seq: Sequence, n: int, tree: TokenTree, path: list[int], next_k: int) -> None:
        """Tell the drafter the outcome of this round right away (it starts the next bundle on it)."""
        st = self.state.get(seq.request_id)
        if st is None:  # the drafter has not heard of the request yet (a quiet step held it back)
            return
        now = time.perf_counter()
        st.verify_end = now
        accepted = [tree.token_ids[i] for i in path]
        slot = path[-1] + 1 if path else 0
        if st.speculating:  # an empty backup's round too: it made 1 token, and its source's means must show it
            tokens = len(accepted) + 1
            s = self.stats
            s.tree_nodes += tree.num_nodes
            s.max_tree_nodes = max(s.max_tree_nodes, tree.num_nodes)
            s.off_spine_rounds += int(slot > len(path))
            if st.verified_lookup is not None:
                s.lookup_nodes += tree.num_nodes - st.verified_lookup
                s.lookup_tokens += sum(1 for i in path if i >= st.verified_lookup)
            if st.jit_attempted:
                s.jit_attempt_rounds += 1
                s.tokens_on_jit_attempts += tokens
            while len(s.accepted_hist) <= len(accepted):
                s.accepted_hist.append(0)
            s.accepted_hist[len(accepted)] += 1
            if st.used_hit:
                s.hit_rounds += 1
                s.tokens_on_hit += tokens
            else:
                s.tokens_on_miss += tokens
                if st.source == "late_bundle":
                    s.bundle_wait_rounds += 1
                    s.tokens_on_bundle_wait += tokens
                elif st.source == "jit":
                    s.jit_rounds += 1
                    s.tokens_on_jit += tokens
                else:
                    s.backup_rounds += 1
                    s.tokens_on_backup += tokens
        if not seq.finished and len(seq.token_ids) > n + len(path):
            bonus = seq.token_ids[n + len(path)]
            if next_k == 0 and not tree.num_nodes and not seq.reproducible:
                st.deferred.extend(accepted + [bonus])  # a plain round, and the next is plain too: tell it later
                self.stats.deferred_outcomes += 1
            else:
                self._send_outcome(seq, st.round, list(st.verified), bonus, next_k, now, st.verified_parents,
                                   slot, len(accepted))
            st.last_key = (slot, bonus)
        st.round += 1
        st.jit_attempted = st.speculating = False

    def _send_deferred(self, seq: Sequence, st: SSDRequestState, k: int) -> None:
        """The plain rounds since the drafter last heard, as one outcome of the last of them: its "speculation"
        is their tokens, all accepted, then the last as the bonus (the drafter has no bundle for them, so it only
        appends them, as it would have one event at a time)."""
        tokens, st.deferred = st.deferred, []
        self._send_outcome(seq, st.round - 1, tokens[:-1], tokens[-1], k, time.perf_counter())

    def _send_outcome(self, seq: Sequence, round_: int, verified: list[int], bonus: int, next_k: int,
                      sent_at: float, parents: list[int] | None = None, slot: int | None = None,
                      num_accepted: int | None = None) -> None:
        """One :class:`OutcomeEvent` to the drafter (``num_accepted`` None: all of ``verified``, a chain). Unless
        the next round is plain, the drafter answers with the bundle for round ``round_ + 1``."""
        st = self.state[seq.request_id]
        st.asked = {r for r in st.asked if r >= round_} | ({round_ + 1} if next_k > 0 else set())
        self.link.send(OutcomeEvent(seq.request_id, round_, verified,
                                    len(verified) if num_accepted is None else num_accepted, bonus, next_k,
                                    verify_s=self.verify_s_ema, sent_at=sent_at,
                                    jit=self.jit_allowed or seq.reproducible, parents=parents, slot=slot,
                                    node_cost=self.verify_costs.node_cost(), step_s=self.verify_costs.table(),
                                    step_others=max(0, self.verify_costs.last_tokens - len(verified) - 1)))

    def replace_link(self, link: DrafterLink) -> None:
        """Switch to a new drafter connection (e.g. a restarted drafter, which knows nothing). Call between steps:
        every active request starts over with a prefill event on its next round."""
        self.link = link
        self.state.clear()
        self.reconnects += 1

    def choose_backup(self, b: int) -> str:
        """'neural' (wait for a JIT draft on a miss) or 'fast' (n-gram at once) for a step of ``b`` requests."""
        if self.backup_policy != "auto":
            return self.backup_policy
        from spec_core.policy import BackupCost, choose_backup

        s = self.stats
        self._policy_steps += 1
        # Explore: the neural backup's value is only known from rounds that used it, so it is tried until there
        # is evidence (8 JIT rounds), and again every 64 steps in case conditions changed.
        # Waiting for a JIT draft is judged by every round that waited, including waits that timed out.
        if s.rounds < 8 or s.jit_attempt_rounds < 8 or self._policy_steps % 64 == 0:
            return "neural"
        p_hit = s.hits / s.rounds
        e_jit = s.tokens_on_jit_attempts / s.jit_attempt_rounds
        t_jit = s.jit_wait_s / s.jit_attempt_rounds / self.verify_s_ema
        return choose_backup(b, p_hit, s.e_bundle(), BackupCost(max(e_jit, 1e-3), min(t_jit, 10.0)),
                             BackupCost(s.e_fast(), 0.0), t_p=1.0)

    def observe_verify_time(self, seconds: float, tokens: int = 0) -> None:
        self.verify_s_ema = 0.8 * self.verify_s_ema + 0.2 * seconds
        if tokens:
            self.verify_costs.observe(tokens, seconds)

    def release(self, seq: Sequence) -> None:
        if self.state.pop(seq.request_id, None) is not None:
            self.link.send(FreeEvent(seq.request_id))
