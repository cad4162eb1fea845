"""Device timing: the host clock on a CPU (CUDA events on a GPU: tests/gpu)."""

from __future__ import annotations

import time

import torch

from spec_core.timing import DeviceTimer


def test_cpu_timer_measures_the_region():
    with DeviceTimer(torch.device("cpu")) as t:
        time.sleep(0.05)
    assert 0.045 <= t.elapsed_s() < 0.5
