"""KV pools sized from free memory."""

from __future__ import annotations

import pytest
import torch

from spec_core.kv_budget import blocks_for_memory, free_bytes


def test_blocks_follow_the_fraction_and_the_cpu_cap(monkeypatch):
    from spec_core import kv_budget

    assert free_bytes(torch.device("cpu")) > 0
    monkeypatch.setattr(kv_budget, "free_bytes", lambda device: 8 << 30)  # the machine's own changes between calls
    cpu = torch.device("cpu")
    per_token = 30 * 2 * 192 * 2  # the real target's K/V bytes per token in bf16
    tiny = blocks_for_memory(per_token, 16, cpu, 0.001, cpu_cap_bytes=1 << 40)
    more = blocks_for_memory(per_token, 16, cpu, 0.01, cpu_cap_bytes=1 << 40)
    assert more > tiny >= 16
    assert abs(more / tiny - 10) < 1  # linear in the fraction
    capped = blocks_for_memory(per_token, 16, cpu, 1.0, cpu_cap_bytes=64 << 20)
    assert capped == (64 << 20) // (per_token * 16)
    with pytest.raises(ValueError, match="memory_fraction"):
        blocks_for_memory(per_token, 16, cpu, 0.0)


def test_pool_size_precedence():
    from spec_core.kv_budget import pool_blocks

    cpu = torch.device("cpu")
    assert pool_blocks(100, 0.5, 1000, 16, cpu, 2048) == 100  # an explicit size wins
    assert pool_blocks(None, None, 1000, 16, cpu, 2048) == 2048  # a CPU without a fraction keeps its default
    assert pool_blocks(None, 0.001, 1000, 16, cpu, 2048) == blocks_for_memory(1000, 16, cpu, 0.001)


def test_cache_config_refuses_a_bad_fraction():
    from spec_core.config import CacheConfig

    with pytest.raises(ValueError, match="kv_memory_fraction"):
        CacheConfig(kv_memory_fraction=1.5)
