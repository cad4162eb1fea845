"""Device memory: the weights load straight to the GPU (peak ≤ 1.2× their size), and the KV pool is sized from
the memory left free."""

from __future__ import annotations

import pytest
import torch

from spec_core.kv_budget import blocks_for_memory
from spec_core.runner import ModelRunner

pytestmark = pytest.mark.gpu


def test_weights_load_straight_to_the_device(real_pair, device, log):
    dev = torch.device(device)
    if dev.type != "cuda":
        return  # a CPU dry run has no device peak to read
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    runner = ModelRunner(real_pair["target"], dtype=torch.bfloat16, device=dev)
    held = torch.cuda.memory_allocated(dev) - base
    peak = torch.cuda.max_memory_allocated(dev) - base
    log(f"bf16 target on {dev}: weights {held / 2**20:.0f} MiB, load peak {peak / 2**20:.0f} MiB "
        f"({peak / held:.2f}x)")
    assert peak <= 1.2 * held, (peak, held)
    del runner


def test_kv_pool_is_sized_from_free_memory(real_pair, device, log):
    dev = torch.device(device)
    runner = ModelRunner(real_pair["draft"], dtype=torch.bfloat16, device=dev)
    small = blocks_for_memory(runner.kv_bytes_per_token(), 16, dev, 0.05)
    big = blocks_for_memory(runner.kv_bytes_per_token(), 16, dev, 0.5)
    log(f"KV blocks of 16 tokens on {dev}: {small} at 5% of free memory, {big} at 50%")
    assert big >= small >= 16


def test_device_timer_times_kernels_not_launches(device, log):
    from spec_core.timing import DeviceTimer

    dev = torch.device(device)
    x = torch.randn(4096, 4096, device=dev)
    with DeviceTimer(dev) as t:
        for _ in range(20):
            x = x @ x / 64
    log(f"20 x 4096^2 matmuls on {dev}: {t.elapsed_s() * 1e3:.1f} ms")
    assert t.elapsed_s() > 0
