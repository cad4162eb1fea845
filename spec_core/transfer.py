"""The host↔device boundary of the hot paths: every crossing goes through :func:`to_device` or :func:`to_host`.

On a GPU each crossing is a synchronisation point (a copy the host waits for, or a launch queue drained), so the
hot-path modules (engine, proposers, sampling, tree, packing, runner) create host data only as Python lists and
cross with these two helpers, which count. ``crossings()`` is read by the engine (a per-step metric) and by the
tests that hold a greedy verifier step to one upload and one download.

Host-only values (block tables, token lists, slot lists) stay Python lists; device values stay tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Crossings:
    uploads: int = 0
    downloads: int = 0

    @property
    def total(self) -> int:
        return self.uploads + self.downloads


_local = threading.local()


def crossings() -> Crossings:
    """This thread's counters (each engine runs its steps on one thread)."""
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = Crossings()
    return c


def to_device(data: Sequence | torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """One upload: host values (a nested list, or a host tensor) → a tensor on ``device``."""
    crossings().uploads += 1
    if isinstance(data, torch.Tensor):
        return data.to(device=device, dtype=dtype or data.dtype)
    return torch.tensor(data, dtype=dtype, device=device)


def to_host(t: torch.Tensor) -> list:
    """One download: a device tensor → nested Python lists (one ``.tolist()``)."""
    crossings().downloads += 1
    return t.tolist()
