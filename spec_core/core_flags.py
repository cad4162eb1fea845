"""Shared-memory flags between a local verifier and its run-ahead drafter process, each pinned to a core of its own.

Each side lends its core to the other while it has nothing to run:

- ``waiting``: set by the verifier while it waits for the drafter's chain; the drafter's steps then run on both
  cores (:mod:`drafter_service.core_borrowing`).
- ``idle``: set by the drafter while it has nothing to draft (every chain at its depth); a verify that starts then
  runs on both cores (:class:`verifier_service.core_lending.CoreLending`).
- ``alternate``: set by the verifier's schedule (:mod:`verifier_service.run_ahead_schedule`): the drafter stops each
  chain at the next round's K tokens instead of running on, so that the two sides take turns on both cores.

Only timing depends on them: which tokens a chain holds never does, and the compiled kernels give the same floats on
one thread or two.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CoreFlags:
    """Three one-byte flags in shared memory (``multiprocessing`` raw values of the spawn context); pass the whole
    object to the drafter process when it is started."""

    waiting: Any
    idle: Any
    alternate: Any

    @classmethod
    def new(cls) -> CoreFlags:
        ctx = mp.get_context("spawn")
        return cls(ctx.RawValue("b", 0), ctx.RawValue("b", 0), ctx.RawValue("b", 0))
