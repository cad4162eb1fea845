"""KV pools sized from free memory."""

from __future__ import annotations

import pytest
import torch

from spec_core.kv_budget import blocks_for_memory, free_bytes


def test_blocks_follow_the_fraction_and_the_cpu_cap():
    cpu = torch.device("cpu")
    per_token = 30 * 2 * 192 * 2  # the real target's K/V bytes per token in bf16
    tiny = blocks_for_memory(per_token, 16, cpu, 0.001, cpu_cap_bytes=1 << 40)
    more = blocks_for_memory(per_token, 16, cpu, 0.01, cpu_cap_bytes=1 << 40)
    assert more > tiny >= 16
    assert abs(more / tiny - 10) < 1  # linear in the fraction
    capped = blocks_for_memory(per_token, 16, cpu, 1.0, cpu_cap_bytes=64 << 20)
    assert capped == (64 << 20) // (per_token * 16)
    assert free_bytes(cpu) > 0
    with pytest.raises(ValueError, match="memory_fraction"):
        blocks_for_memory(per_token, 16, cpu, 0.0)
