"""``ssd serve`` checks its ports before it loads anything: a busy one is one line and a non-zero exit, fast."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize("flag", ["--http-port", "--port"])
def test_a_busy_port_fails_at_once_with_one_line(flag):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = {"--port": "0", flag: str(port)}
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "ssd_cli", "serve", *(x for kv in args.items() for x in kv)],
                              capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - t0
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"ssd: error: {flag} {port}: cannot listen on 127.0.0.1:{port} (Address already in use); is "
                     "another server running there? Choose another port, or 0 for any free one"], proc.stderr
    assert "loading" not in proc.stdout and elapsed < 10, (proc.stdout, elapsed)
