"""The SSD proposer's counters (rounds, hits and misses by cause, what arrived from the drafter, candidate trees), and
the decision they feed: how long to wait for a bundle the drafter is still building."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class SSDStats:
    rounds: int = 0
    hits: int = 0
    jit: int = 0
    backup: int = 0
    wait_s: float = 0.0
    #: The longest single wait for a just-in-time draft (bounded by ``wait_fraction`` × a verify).
    max_wait_s: float = 0.0
    tokens_on_hit: int = 0
    tokens_on_miss: int = 0
    hit_rounds: int = 0
    jit_rounds: int = 0
    tokens_on_jit: int = 0
    backup_rounds: int = 0
    tokens_on_backup: int = 0
    jit_wait_s: float = 0.0
    #: Rounds in which the verifier waited for a JIT draft (whether or not it came in time), and their tokens.
    jit_attempt_rounds: int = 0
    tokens_on_jit_attempts: int = 0
    #: Histogram of accepted tokens per speculating round: accepted_hist[j] = rounds that accepted j tokens.
    accepted_hist: list[int] = field(default_factory=list)
    #: Steps on which the backup policy chose the fast (n-gram) backup instead of waiting for a JIT draft.
    fast_backup_steps: int = 0
    #: Misses by what served the round: a just-in-time (or late) draft, or the backup (or nothing).
    #: Invariant: ``hits + jit_misses + backup_misses == rounds``.
    jit_misses: int = 0
    backup_misses: int = 0
    #: What arrived from the drafter (lifetime, across reconnects): bundles, the branches in them, JIT drafts.
    bundles_received: int = 0
    branches_received: int = 0
    jit_received: int = 0
    #: Candidate trees: nodes verified over speculating rounds (in all, and the most in one round: more than K
    #: only for a tree, as backups and just-in-time drafts are chains), rounds whose accepted path left the spine, and
    #: hits by the kind of outcome they predicted: all of the spine accepted, a rejection on it, or a path
    #: through an off-spine node.
    tree_nodes: int = 0
    max_tree_nodes: int = 0
    off_spine_rounds: int = 0
    hits_all_accepted: int = 0
    hits_rejected: int = 0
    hits_off_spine: int = 0
    #: The prompt-lookup branch (:class:`spec_core.config.TreeShape`): its nodes verified, and its tokens accepted.
    lookup_nodes: int = 0
    lookup_tokens: int = 0
    #: Why rounds missed: the bundle had the outcome but arrived after the verify ended (it is still used), the
    #: bundle lacked the outcome (the prediction failed), or no bundle for that speculation had arrived.
    misses_late: int = 0
    misses_unpredicted: int = 0
    misses_no_bundle: int = 0
    misses_other_base: int = 0
    #: Plain rounds whose outcome waited to go to the drafter with the request's next speculating round.
    deferred_outcomes: int = 0
    #: Waits for a bundle still being built (the fast backup's short wait, :func:`bundle_wait`): rounds that
    #: waited, rounds a bundle then served and their tokens, and the time spent waiting.
    bundle_wait_attempts: int = 0
    bundle_wait_rounds: int = 0
    tokens_on_bundle_wait: int = 0
    bundle_wait_s: float = 0.0

    def count_hit(self, slot: int, spine: int) -> None:
        """A hit on the outcome in tree ``slot`` of a speculation whose spine is ``spine`` tokens long: past the
        spine (a leaf), the whole spine accepted, or a rejection within it."""
        if slot > spine:
            self.hits_off_spine += 1
        elif slot == spine:
            self.hits_all_accepted += 1
        else:
            self.hits_rejected += 1

    def e_bundle(self) -> float:
        """Tokens per round served by a pre-drafted bundle (a hit, or a bundle waited for), with a prior of 2 tokens
        worth 2 rounds."""
        return (self.tokens_on_hit + self.tokens_on_bundle_wait + 4.0) / (self.hit_rounds + self.bundle_wait_rounds
                                                                          + 2)

    def e_fast(self) -> float:
        """Tokens per round served by the n-gram backup, counting rounds where it found nothing (1 token), with a
        prior of 1 token worth 2 rounds. (Leaving out the empty ones made the backup look as good as a hit on
        code: 2.75 tokens per round against 2.23 with them.)"""
        return (self.tokens_on_backup + 2.0) / (self.backup_rounds + 2)

    @property
    def mean_tree_nodes(self) -> float | None:
        spec_rounds = sum(self.accepted_hist)
        return self.tree_nodes / spec_rounds if spec_rounds else None

    @property
    def cache_hit_rate(self) -> float | None:
        return self.hits / self.rounds if self.rounds else None


#: A bundle's ``ready_at`` is when the drafter finished it (or, over gRPC, when it arrived): a wait for it allows
#: this much more for the pipe and the decoding.
BUNDLE_TRANSIT_S = 0.003


def bundle_gain(s: SSDStats) -> float:
    """How many more tokens a round served by a pre-drafted bundle makes than one served by the n-gram backup, as a
    fraction of the latter (:meth:`SSDStats.e_bundle`, :meth:`SSDStats.e_fast`)."""
    return s.e_bundle() / s.e_fast() - 1.0


def bundle_wait(lateness: Sequence[float], gain: float, verify_s: float, cap_s: float, share: float = 1.0) -> float:
    """Seconds to wait for a bundle the drafter is still building, rather than serve the n-gram backup at once.

    ``lateness``: how long after their verify ended recent bundles that were not there in time became ready
    (``inf``: never). Waiting w for a round worth ``gain`` more when served by its bundle, which comes within w
    with probability P(lateness <= w), pays ``P · gain · share - w / verify_s`` of a round in expectation (a
    wait that succeeds ends early, so this is the worst case; ``share``: the fraction of the batch that is due,
    as the whole batch waits). The wait is the w among the observed lateness values (plus ``BUNDLE_TRANSIT_S``,
    for the message to arrive) that maximises it, at most ``cap_s``; 0 where none pays or nothing has been
    observed."""
    if not lateness or gain <= 0 or verify_s <= 0:
        return 0.0
    best, best_w = 0.0, 0.0
    for i, late in enumerate(sorted(lateness)):
        w = max(late, 0.0) + BUNDLE_TRANSIT_S
        if w > cap_s:
            break
        value = (i + 1) / len(lateness) * gain * share - w / verify_s
        if value > best:
            best, best_w = value, w
    return best_w
