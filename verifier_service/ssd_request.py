"""The verifier's per-request SSD state: one object per request, kept by the SSD proposer."""

from __future__ import annotations

from dataclasses import dataclass, field

from spec_core.speculation import BranchBundle, Speculation


@dataclass(slots=True)
class SSDRequestState:
    """The verifier's SSD state of one request: its round, what it verified, the bundles and drafts the drafter
    sent for it, and what it is waiting for."""

    round: int = 0
    verified: list[int] = field(default_factory=list)
    verified_parents: list[int] | None = None  # None: ``verified`` is a chain
    verified_lookup: int | None = None  # its first prompt-lookup node (None: it has none)
    last_key: tuple[int, int] | None = None
    verify_end: float = 0.0
    used_hit: bool = False
    source: str = "none"  # where this round's speculation came from: hit | jit | backup | none
    jit_attempted: bool = False
    #: Whether this round speculates (K > 0 after round 0), even if nothing served it (an empty backup): such a
    #: round still counts in its source's tokens per round, at 1 token.
    speculating: bool = False
    miss_kind: str = "no_bundle"
    #: Rounds of the bundles asked of the drafter (by this round's outcome and the last): the one the next
    #: round looks up may still be in the making.
    asked: set[int] = field(default_factory=set)
    #: Bundles asked for that were not there when their round's verify ended: round → that time.
    due: dict[int, float] = field(default_factory=dict)
    bundles: dict[int, BranchBundle] = field(default_factory=dict)
    jit: dict[int, Speculation] = field(default_factory=dict)
    #: Tokens of plain rounds (K = 0) the drafter has not been told yet: it drafts nothing for such rounds, so
    #: their outcomes go in one event when the request next speculates (or never, if it finishes first).
    deferred: list[int] = field(default_factory=list)
    #: Whether a bundle of the drafter's has served this request on time yet. Before that the drafter is still
    #: catching up on the prompt (it prefills beside the target), so waits for it are the request's start-up cost.
    warm: bool = False

    def cold(self) -> bool:
        """Whether a hit was out of reach for this round: the drafter is still catching up on the request, or the
        last round was plain and asked for no bundle (a re-probe). Waits in such rounds are costs of starting to
        speculate, not of speculating (:attr:`verifier_service.ssd_proposer.SSDProposer.cold_wait_s`)."""
        return not self.warm or not self.draft_can_come()

    def draft_can_come(self) -> bool:
        """Whether a wait for this round's draft can pay: the drafter was asked for this round's bundle. A re-probe
        after plain rounds asked for nothing, and its drafter first catches up on their tokens, so a just-in-time
        draft comes late: at batch 16 the steps of the window after each hold took 2x a plain one. The backup
        serves such rounds at once, and the drafter, told the outcome, has the next round's bundle under way."""
        return self.round - 1 in self.asked
