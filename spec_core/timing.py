"""Device-side timing of a region: CUDA events on a GPU (the region's kernels, not just their launches), the host
clock elsewhere (where a kernel runs when it is called)."""

from __future__ import annotations

import time

import torch


class DeviceTimer:
    """``with DeviceTimer(device) as t: ...`` then ``t.elapsed_s()`` (which waits for the region's end event)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start = self._end = None
        self._t0 = self._t1 = 0.0

    def __enter__(self) -> DeviceTimer:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def elapsed_s(self) -> float:
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._t1 - self._t0
