"""Free local ports for tests that start servers."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1. Every socket stays bound until all are picked: a port closed before
    the next bind may be handed out again (a CI run once gave a Ray head's GCS and its metrics exporter the same
    port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]
