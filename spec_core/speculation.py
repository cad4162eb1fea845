"""Typed messages between the verifier and the SSD drafter (the transport-neutral protocol).

Round numbering: round R verifies speculation S_R. After round R the verifier sends an :class:`OutcomeEvent`
(accepted tokens and the bonus). The drafter pre-builds, *while* round R is verified, a :class:`BranchBundle` for
round R: one speculation per likely outcome key ``(k accepted, bonus token)``. If the outcome's key is in the
bundle that arrived before round R's verification returned, S_{R+1} is that branch (a cache hit); otherwise the
drafter drafts S_{R+1} just in time (:class:`SpeculationMsg`) or the verifier uses a backup.

Every speculation carries the exact distribution each token was sampled from (``draft_probs``, None for greedy
requests), so the verifier never recomputes q.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from spec_core.config import SamplingParams


@dataclass(frozen=True, slots=True)
class Speculation:
    """K proposed tokens following a known root token; ``draft_probs [K, V]`` or None (greedy/deterministic)."""

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    source: str = "cache"

    @property
    def k(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class PrefillEvent:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    k: int


@dataclass(frozen=True, slots=True)
class OutcomeEvent:
    """The verification outcome of ``round``: of the ``verified`` speculation, ``num_accepted`` tokens were
    accepted, then ``bonus`` was sampled. ``next_k`` is the lookahead the verifier will use next round and
    ``verify_s`` its current verify time, so the drafter can tell whether a just-in-time draft would be in time.
    The drafter's branches apply only if ``verified`` is the speculation they were built on.
    """

    request_id: str
    round: int
    verified: list[int]
    num_accepted: int
    bonus: int
    next_k: int
    verify_s: float = 0.0
    sent_at: float = 0.0
    #: False when the verifier will not wait for a just-in-time draft on a miss (its backup policy chose the fast
    #: backup): the drafter then builds straight on the backup speculation.
    jit: bool = True

    @property
    def key(self) -> tuple[int, int]:
        return (self.num_accepted, self.bonus)

    @property
    def accepted(self) -> list[int]:
        return self.verified[: self.num_accepted]


@dataclass(frozen=True, slots=True)
class FreeEvent:
    request_id: str


@dataclass(frozen=True, slots=True)
class SpeculationMsg:
    """A just-in-time speculation for ``round`` (after a miss)."""

    request_id: str
    round: int
    speculation: Speculation


@dataclass(slots=True)
class BranchBundle:
    """Pre-drafted speculations for the outcomes of ``round``, keyed by ``(k, bonus)``, built assuming round
    ``round`` verifies ``base_tokens``."""

    request_id: str
    round: int
    base_tokens: list[int]
    entries: dict[tuple[int, int], Speculation] = field(default_factory=dict)
    ready_at: float = 0.0


@runtime_checkable
class DrafterLink(Protocol):
    """The verifier's end of a drafter connection: the interface every transport implements (the gRPC stream,
    the local process pipe, the in-process loopback), carrying the codec's messages.

    Events (:class:`PrefillEvent`, :class:`OutcomeEvent`, :class:`FreeEvent`) go to the drafter; speculations
    (:class:`BranchBundle`, :class:`SpeculationMsg`) come back. ``send`` never blocks; ``flush`` delivers what a
    batching transport holds (called after proposing, before the verify); ``alive`` turns False once the drafter
    is gone, after which ``poll`` only drains what already arrived.
    """

    @property
    def alive(self) -> bool: ...

    def send(self, msg: object) -> None: ...

    def poll(self, timeout: float | None = 0.0) -> bool: ...

    def recv(self) -> object: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...
