"""The run-ahead drafter borrowing the verifier's core while the verifier waits for it (local SSD on a CPU).

With a draft that costs a large share of a target step, the drafter is the slower side: after a miss the
verifier has nothing to verify until the drafter has drafted the next K tokens, and its core idles. While the
verifier says it waits (a flag in shared memory, set around its wait), each draft step runs on both cores (affinity
over both, two threads); once the flag drops, the next step is back on the drafter's own core. A step under way
when the verifier resumes finishes on both (one draft step of overlap at most).

Only where it pays: a decode step on two cores is not always faster than on one (where one core already draws
the memory bandwidth the machine gives, the second only adds a handoff). So the drafter times its one-token steps
on one core and on two, and borrows while two are measured faster, trying both again now and then.

Only where the draft's matmuls are the compiled kernels (int4, w8a8, gguf weights): they split a call over its
outputs, so two threads give the same floats as one, and a seeded request's draft never depends on when it
borrowed.
"""

from __future__ import annotations

import logging
import os

import torch

from spec_core.runner import ModelRunner

logger = logging.getLogger(__name__)


#: One step in this many on each side while the other is measured faster (the machine's load changes).
REPROBE = 64
#: Two cores are used while their measured step is below this share of one core's.
GAIN = 0.95


class CoreBorrowing:
    """Per draft step, both cores while ``flag.value`` is set and two cores are measured faster, else the drafter's
    own."""

    def __init__(self, flag, own_core: int, lend_core: int) -> None:
        self.flag = flag
        self.own, self.both = {own_core}, {own_core, lend_core}
        self.on = False
        #: Draft steps run on both cores (for reports and tests).
        self.borrowed_steps = 0
        #: Recent seconds of a one-token step on one core and on two (None: not measured yet).
        self.step_s: dict[bool, float | None] = {False: None, True: None}
        self._steps = 0

    def pays(self) -> bool:
        """Whether two cores are measured faster for a one-token step (or one of them is still unmeasured, or it
        is time to measure the slower one again)."""
        one, two = self.step_s[False], self.step_s[True]
        self._steps += 1
        if one is None or two is None:
            return two is None  # measure two cores first, then one
        faster = two < GAIN * one
        return not faster if self._steps % REPROBE == 0 else faster

    def observe(self, seconds: float) -> None:
        """The time of the step just run, when it fed one token per request (a decode step)."""
        old = self.step_s[self.on]
        self.step_s[self.on] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def before_step(self) -> None:
        want = bool(self.flag.value) and self.pays()
        if want != self.on:
            try:
                os.sched_setaffinity(0, self.both if want else self.own)
            except OSError as exc:
                logger.warning("cannot borrow the verifier's core (%s): the drafter keeps its own", exc)
                self.flag = _Never()
                return
            torch.set_num_threads(2 if want else 1)
            self.on = want
        self.borrowed_steps += int(self.on)


class _Never:
    value = 0


def core_borrowing(flag, own_core: int | None, lend_core: int | None, runner: ModelRunner) -> CoreBorrowing | None:
    """A :class:`CoreBorrowing` where it applies (module docstring), else None."""
    if flag is None or own_core is None or lend_core is None or own_core == lend_core:
        return None
    if runner.device.type != "cpu" or runner.kernels is None or runner.weights is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        return None
    return CoreBorrowing(flag, own_core, lend_core)
