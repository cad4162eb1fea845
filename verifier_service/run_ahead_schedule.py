"""Pipelined or alternating: how a run-ahead pair spends its two cores, chosen by measurement.

- **Pipelined** (SSD's own schedule): while the verifier verifies a round on its core, the drafter drafts the next
  round's chain on its own, past the round's K tokens up to its run-ahead depth.
- **Alternating**: the drafter stops each chain at the next round's K tokens and idles, so the verify runs on both
  cores (:mod:`verifier_service.core_lending`); while the verifier then waits for the next K tokens, the drafter runs
  on both (:mod:`drafter_service.core_borrowing`).

Which is faster depends on the machine. On separate devices, or cores with memory bandwidth to spare, the overlap
wins. Where the two cores share the bandwidth both models are bound by (2-vCPU machines), a verify beside a drafting
drafter slows by half, every chain token drafted past a rejection is read for nothing, and the sides go faster taking
turns. So in ``auto`` the schedule times both: a window of rounds in each, then the faster of the two, with the
other timed again every ``reprobe`` rounds. A round's time is the wall time from one proposal to the next: the
wait for the drafter included. Rounds are compared only at one batch size: a new size measures both again.

Only timing depends on the schedule: the tokens of a chain and the verification do not.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PIPELINED, ALTERNATING = "pipelined", "alternating"
RUN_AHEAD_SCHEDULES = ("auto", PIPELINED, ALTERNATING)


@dataclass(slots=True)
class RunAheadSchedule:
    """The schedule in force (:attr:`current`) and the measured round times behind the choice."""

    #: ``auto`` (measured), or one schedule always.
    mode: str = "auto"
    #: Rounds a measurement takes, rounds skipped after a switch (the drafter's chains adjust), and rounds in
    #: the faster schedule before the slower one is timed again.
    window: int = 12
    settle: int = 2
    reprobe: int = 256
    current: str = PIPELINED
    #: The median round seconds last measured per (schedule, batch size).
    round_s: dict[tuple[str, int], float] = field(default_factory=dict)
    #: Rounds run in each schedule (for reports).
    rounds: dict[str, int] = field(default_factory=lambda: {PIPELINED: 0, ALTERNATING: 0})
    _samples: list[float] = field(default_factory=list)
    _settle_left: int = 0
    _batch: int = 0
    _since_choice: int = 0

    def __post_init__(self) -> None:
        if self.mode not in RUN_AHEAD_SCHEDULES:
            raise ValueError(f"run-ahead schedule must be one of {', '.join(RUN_AHEAD_SCHEDULES)}, got {self.mode!r}")
        if self.mode != "auto":
            self.current = self.mode

    @property
    def alternating(self) -> bool:
        return self.current == ALTERNATING

    def observe(self, batch: int, seconds: float) -> None:
        """A round of ``batch`` speculating requests took ``seconds``, proposal to proposal."""
        self.rounds[self.current] += 1
        if self.mode != "auto":
            return
        if batch != self._batch:
            self._batch, self._samples, self._settle_left = batch, [], self.settle
        if self._settle_left:
            self._settle_left -= 1
            return
        self._samples.append(seconds)
        self._since_choice += 1
        if len(self._samples) < self.window:
            return
        self.round_s[(self.current, batch)] = statistics.median(self._samples)
        self._samples = []
        self._decide(batch)

    def _decide(self, batch: int) -> None:
        """After a window: back to the other schedule where it was measured faster, time it where it is unmeasured
        or due, else stay."""
        other = ALTERNATING if self.current == PIPELINED else PIPELINED
        mine, theirs = self.round_s[(self.current, batch)], self.round_s.get((other, batch))
        if theirs is None or theirs < mine or self._since_choice >= self.reprobe:
            self._switch(other)

    def _switch(self, schedule: str) -> None:
        self.current, self._settle_left, self._since_choice = schedule, self.settle, 0
