"""The verifier's end of a drafter link that only records what it sends (proposer unit tests; the drafter is
not under test there)."""

from __future__ import annotations


class Outbox:
    alive = True

    def __init__(self) -> None:
        self.sent = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def poll(self, timeout: float = 0.0) -> bool:
        return False

    def flush(self) -> None:
        pass
