"""An in-process transport: the drafter handles buffered events synchronously, in one batch, on each flush.

Every bundle is therefore ready before the verifier looks for it (the timing-free regime), which makes the SSD
loop deterministic for seeded tests. Production uses :mod:`drafter_service.process` (or gRPC).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from drafter_service.process import DrafterLoop
from drafter_service.ssd_drafter import SSDDrafter


class _Inbox:
    def __init__(self) -> None:
        self.items: deque = deque()


class _DrafterEnd:
    def __init__(self, to_verifier: _Inbox) -> None:
        self.to_verifier = to_verifier

    def send(self, msg: object) -> None:
        self.to_verifier.items.append(msg)


class LoopbackLink:
    """The verifier's end of the link. Sends are buffered; ``flush`` (called by the verifier after proposing, i.e.
    before it verifies) and ``poll`` run the drafter on them, so the drafter always finishes "during" the verify."""

    def __init__(self, drafter: SSDDrafter, backup: str = "ngram", jit: bool = True) -> None:
        """``jit=False`` makes the drafter treat just-in-time drafts as always late (so misses use the backup).
        The drafter builds inside the verifier's step here, so its fan-out is never fitted to that step."""
        drafter.config = replace(drafter.config, fit_fanout=None)
        self.to_drafter: list[object] = []
        self.to_verifier = _Inbox()
        self.loop = DrafterLoop(drafter, _DrafterEnd(self.to_verifier), backup=backup,
                                wait_fraction=float("inf") if jit else 0.0)

    alive = True  # the drafter runs in this process, on this thread

    def send(self, msg: object) -> None:
        self.to_drafter.append(msg)

    def close(self) -> None:
        self.to_drafter.clear()

    def flush(self) -> None:
        if self.to_drafter:
            events, self.to_drafter = self.to_drafter, []
            self.loop.handle(events)

    def poll(self, timeout: float | None = 0.0) -> bool:
        self.flush()
        return bool(self.to_verifier.items)

    def recv(self) -> object:
        return self.to_verifier.items.popleft()
