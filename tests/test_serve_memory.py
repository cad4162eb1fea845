"""Memory: the paged K/V pool costs resident memory only for the slots requests have written, so ``ssd serve`` at
its defaults holds at most 1.5 GB in its verifier process after serving a request (its ``process_*`` metrics)."""

from __future__ import annotations

import os
import re
import urllib.request

import torch
from conftest import start_served

from spec_core.kv_cache import zeroed

LIMIT_BYTES = 1.5e9


def _rss_mb() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


def test_a_cpu_pool_is_resident_only_where_written():
    before = _rss_mb()
    pool = zeroed((30, 32769, 6, 64), torch.float32, torch.device("cpu"))  # 1.5 GB: SmolLM2's default pool
    assert _rss_mb() - before < 64
    assert pool.is_contiguous() and float(pool.abs().sum()) == 0.0  # reading zero pages maps none
    assert _rss_mb() - before < 64
    pool[:, :64].fill_(1.0)  # what a short request writes
    assert _rss_mb() - before < 200
    assert zeroed((4, 8), torch.bfloat16, torch.device("cpu")).dtype == torch.bfloat16


def test_serve_at_its_defaults_holds_at_most_1_5_gb_in_the_verifier():
    from spec_core.config import SamplingParams
    from verifier_service.client import SSDClient

    proc, info = start_served()
    try:
        # int4 at the defaults, both actors pinned on this node: plain steps may borrow the drafter's core
        assert info["verifier"]["lending"] is (len(os.sched_getaffinity(0)) >= 2)
        with SSDClient(info["address"]) as client:
            result = client.generate_all("def add(a, b):", SamplingParams(max_new_tokens=64))
        assert result.streamed_token_ids
        with urllib.request.urlopen(f"http://{info['verifier']['metrics_address']}/metrics", timeout=30) as r:
            text = r.read().decode()
        rss = float(re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M).group(1))
        print(f"verifier RSS after one request at defaults: {rss / 1e9:.2f} GB")
        assert rss <= LIMIT_BYTES, rss
    finally:
        proc.kill()
        proc.wait(timeout=60)
