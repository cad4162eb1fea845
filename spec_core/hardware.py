"""What CPU this is, in the terms the benchmarks are reported in: its name and its class (AVX2, AVX-512,
AVX-512 BF16, AMX), read from ``/proc/cpuinfo`` (stdlib only)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

#: Classes from the most capable down: the first whose flag the CPU has.
CLASSES = (("amx_tile", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


@functools.cache
def _cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def cpu_flags() -> set[str]:
    info = _cpuinfo()
    return set((info.get("flags") or info.get("Features") or "").split())


def cpu_name() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_class(flags: set[str] | None = None) -> str:
    """``AMX``, ``AVX-512 BF16``, ``AVX-512`` or ``AVX2`` for an x86 CPU, else its architecture."""
    flags = cpu_flags() if flags is None else flags
    return next((name for flag, name in CLASSES if flag in flags), platform.machine())


def describe() -> str:
    """One line for reports: the CPU's name, class and logical cores."""
    import os

    return f"{cpu_name()} ({cpu_class()}, {os.cpu_count()} logical cores)"
