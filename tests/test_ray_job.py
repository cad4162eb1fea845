"""``ray job submit -- ssd batch ... --mode ssd`` against a real local head started with ``ray start``.

The head gets its own ports and temp dir, and is ended by PID (every process whose command line names that temp
dir), never with ``ray stop``, which would kill every Ray process of the user.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from local_ports import free_ports

PROMPTS = ["def mean(xs):\n", "import sys\n\n\ndef main():\n", "class Point:\n    def __init__(self, x, y):\n"]


def _pids_mentioning(text: str) -> list[int]:
    """Processes whose command line names ``text``, and all their descendants (Ray renames some children)."""
    parent, found = {}, set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.add(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    changed = True
    while changed:
        new = {pid for pid, pp in parent.items() if pp in found} - found
        found |= new
        changed = bool(new)
    return sorted(found)


@pytest.fixture(scope="module")
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="rjt", dir="/tmp")
    # Every port of its own: the test session's embedded Ray already holds the defaults (e.g. the dashboard
    # agent's 52365), and a head whose agent cannot bind answers "No available agent to submit job".
    gcs, dash, client, agent_http, agent_grpc, metrics, runtime_env = free_ports(7)
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
    start = subprocess.run(
        [f"{bin_dir}/ray", "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={runtime_env}", "--dashboard-host=127.0.0.1", "--num-cpus=2", "--num-gpus=0",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, start.stderr[-2000:]
    yield f"http://127.0.0.1:{dash}", env
    for pid in _pids_mentioning(temp_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    time.sleep(1)
    assert not _pids_mentioning(temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_submit_runs_ssd_batch_on_the_cluster(ray_head, tmp_path, toy_pair, greedy_reference) -> None:
    address, env = ray_head
    work = tmp_path / "job"
    work.mkdir()
    with (work / "prompts.jsonl").open("w") as f:
        for i, p in enumerate(PROMPTS):
            f.write(json.dumps({"id": f"p{i}", "prompt": p, "max_new_tokens": 20, "ignore_eos": True}) + "\n")
    out = tmp_path / "out.jsonl"
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", address, "--working-dir",
           str(work), "--", "ssd", "-v", "batch", "--input", "prompts.jsonl", "--output", str(out), "--mode", "ssd",
           "--k", "2", "--concurrency", "3", "--dtype", "float32", "--target", toy_pair["target"], "--draft", toy_pair["draft"]]
    deadline = time.monotonic() + 120
    while True:  # right after `ray start`, the head's job agent may not be registered yet ("try again later")
        job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if job.returncode == 0 or "No available agent" not in job.stdout + job.stderr or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    assert "succeeded" in job.stdout
    assert "pair placed" in job.stdout  # the drafter and verifier ran as placed actors, not locally
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["p0", "p1", "p2"]
    for r, p in zip(rows, PROMPTS):
        assert r["token_ids"] == greedy_reference(p, 20)
