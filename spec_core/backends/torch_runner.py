"""The :class:`~spec_core.backends.Backend` over :class:`~spec_core.runner.ModelRunner`.

``static=False`` (the default) forwards every batch to the runner's own dynamic ``forward_paged``: the exactness
reference in fp32, the CPU kernels and weight formats where the runner switched them on. ``static=True`` runs each
cache's batches through its static-buffer step (:func:`spec_core.backends.static_step`), graphs on a CUDA device.
"""

from __future__ import annotations

import contextlib

import torch

from spec_core.backends import Capabilities
from spec_core.backends.default import static_step
from spec_core.backends.static_step import Buckets
from spec_core.kv_cache import PagedBatch, PagedKVCache
from spec_core.runner import ModelRunner
from spec_core.timing import DeviceTimer


class RunnerBackend:
    """A :class:`ModelRunner` as a backend; ``runner`` stays reachable for what the protocol does not cover."""

    def __init__(self, runner: ModelRunner, static: bool = False, buckets: Buckets | None = None) -> None:
        self.runner = runner
        self.device, self.dtype = runner.device, runner.dtype
        self.max_positions, self.vocab_size = runner.spec.max_positions, runner.vocab_size
        self.static, self.buckets = static, buckets
        self._steps: dict[int, tuple[PagedKVCache, object]] = {}  # id(cache) -> (cache, its step)

    def forward_paged(self, cache: PagedKVCache, batch: PagedBatch) -> torch.Tensor:
        if not self.static:
            return self.runner.forward_paged(cache, batch)
        entry = self._steps.get(id(cache))
        if entry is None or entry[0] is not cache:
            entry = self._steps[id(cache)] = (cache, static_step(self.runner.forward_paged, cache, self.buckets))
        return entry[1](cache, batch)

    def new_paged_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return self.runner.new_paged_cache(num_blocks, block_size)

    def capabilities(self) -> Capabilities:
        r = self.runner
        return Capabilities(device_type=self.device.type, dtype=self.dtype, exact=r.exact,
                            batch_invariant=r.batch_invariant, graphs=self.static and self.device.type == "cuda",
                            cpu_kernels=r.kernels is not None)

    def timer(self) -> contextlib.AbstractContextManager:
        return DeviceTimer(self.device)

    def kernel_threads(self) -> contextlib.AbstractContextManager:
        return self.runner.kernel_threads()

    def row_padding(self):
        return self.runner.row_padding()
