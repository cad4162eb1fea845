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
    """One upload: host values (a nested list, or a host tensor) → a tensor on ``device``. To a CUDA device the
    copy goes from pinned memory without waiting: an upload from pageable memory would wait for every kernel queued
    before it (a hidden synchronisation in the middle of a step). Stream order keeps its readers after it. Not while
    a CUDA graph is captured: the graph would keep reading a host buffer that is reused."""
    crossings().uploads += 1
    if torch.device(device).type == "cuda" and not torch.cuda.is_current_stream_capturing():
        host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
        return _pinned(host).to(device=device, dtype=dtype or host.dtype, non_blocking=True)
    if isinstance(data, torch.Tensor):
        return data.to(device=device, dtype=dtype or data.dtype)
    return torch.tensor(data, dtype=dtype, device=device)


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """A pinned copy of ``host`` (torch's caching host allocator keeps the block until the copy is done); the tensor
    itself where pinning is refused (a locked-memory limit), whose copy then waits."""
    try:
        return host.pin_memory()
    except RuntimeError:
        return host


def to_host(t: torch.Tensor) -> list:
    """One download: a device tensor → nested Python lists (one ``.tolist()``)."""
    crossings().downloads += 1
    return t.tolist()


class HostCopy:
    """Integer results of one step that the host needs, brought down together: :meth:`add` each device tensor
    (argmaxes, draws, verification outcomes), :meth:`fetch` once (one download), then read each back by its slot as
    the nested lists :func:`to_host` would have given. On a GPU that is one synchronisation instead of one per
    result."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []
        self._values: list[list] | None = None

    def add(self, t: torch.Tensor) -> int:
        """Queue ``t`` (integer-valued); returns its slot."""
        if self._values is not None:
            raise RuntimeError("HostCopy: add after fetch")
        self._tensors.append(t)
        return len(self._tensors) - 1

    def fetch(self) -> None:
        """The one download of everything queued (none when nothing was)."""
        self._values = []
        if not self._tensors:
            return
        flat = to_host(torch.cat([t.reshape(-1).long() for t in self._tensors]))
        start = 0
        for t in self._tensors:
            n = t.numel()
            self._values.append(_nest(flat[start:start + n], list(t.shape)))
            start += n

    def __getitem__(self, slot: int) -> list:
        if self._values is None:
            raise RuntimeError("HostCopy: read before fetch")
        return self._values[slot]


def _nest(flat: list, shape: list[int]) -> list:
    """``flat`` (row-major) as nested lists of ``shape``."""
    if len(shape) <= 1:
        return flat if shape else flat[0]
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
