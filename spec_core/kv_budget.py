"""KV pool sizing from the memory the device has free (as vLLM's ``gpu_memory_utilization``).

The pool is allocated once, up front, so its size is a budget: a ``memory_fraction`` of the memory free when the
engine starts, divided by one block's K/V bytes. On a CPU the free memory is the host's available RAM, capped at
``cpu_cap_bytes`` (a CPU decode of these models never needs more; llama.cpp and vLLM-CPU size it the same way).
"""

from __future__ import annotations

import os

import torch

#: The default CPU cap: 4 GiB of K/V (vLLM's CPU default ``VLLM_CPU_KVCACHE_SPACE``).
CPU_CAP_BYTES = 4 << 30


def free_bytes(device: torch.device) -> int:
    """Memory free on ``device`` now: CUDA's free memory, or the host's available RAM (``MemAvailable``: the page
    cache counts as free, as the kernel gives it back; after reading a large model, free pages alone can be a few
    hundred MB of 24 GB)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            line = next(x for x in f if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def blocks_for_memory(kv_bytes_per_token: int, block_size: int, device: torch.device, memory_fraction: float,
                      cpu_cap_bytes: int = CPU_CAP_BYTES, min_blocks: int = 16) -> int:
    """How many KV blocks fit in ``memory_fraction`` of the device's free memory (at least ``min_blocks``)."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    budget = free_bytes(device) * memory_fraction
    if device.type != "cuda":
        budget = min(budget, cpu_cap_bytes)
    return max(min_blocks, int(budget // (kv_bytes_per_token * block_size)))


#: The default share of a GPU's free memory each KV pool takes when no size is given (two actors may share one).
GPU_DEFAULT_FRACTION = 0.4


def pool_blocks(num_blocks: int | None, memory_fraction: float | None, kv_bytes_per_token: int, block_size: int,
                device: torch.device, cpu_default: int) -> int:
    """A pool's size: ``num_blocks`` if given; else from free memory (``memory_fraction``, or
    :data:`GPU_DEFAULT_FRACTION` on a GPU); else, on a CPU with no fraction, ``cpu_default``."""
    if num_blocks is not None:
        return num_blocks
    if memory_fraction is None and device.type != "cuda":
        return cpu_default
    return blocks_for_memory(kv_bytes_per_token, block_size, device, memory_fraction or GPU_DEFAULT_FRACTION)
