"""Model backends: what the engine needs from a model, as one protocol.

A :class:`Backend` runs a packed ragged batch over a paged K/V cache (:class:`~spec_core.kv_cache.PagedBatch`),
builds that cache, says what it can do (:class:`Capabilities`) and times its own work. The runner behind it is
chosen once: :class:`spec_core.backends.torch_runner.RunnerBackend` wraps :class:`~spec_core.runner.ModelRunner`
(the fp32 torch path, and the CPU backend's kernels and formats, :mod:`spec_core.backends.cpu`, which it switches
on for a CPU), and on a CUDA device adds graph replay (:mod:`spec_core.backends.cuda_graphs`) over the
static-buffer step (:mod:`spec_core.backends.static_step`); :mod:`spec_core.backends.default` picks them.

Layout: this package's own modules import nothing of the CPU backend; the CUDA-graph module and the CPU backend
import nothing of each other (``tests/test_backends.py``), and the engines import only this protocol
(``tests/test_engine_layout.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from spec_core.kv_cache import PagedBatch, PagedKVCache


@dataclass(frozen=True)
class Capabilities:
    """What a backend does.

    exact: its fp32 logits are the exactness reference's arithmetic (transformers' within 1e-4).
    batch_invariant: a token's logits do not depend on the other rows and tokens of its forward.
    graphs: forwards replay captured CUDA graphs from static buffers.
    cpu_kernels: the compiled CPU kernels run its forwards.
    """

    device_type: str
    dtype: torch.dtype
    exact: bool
    batch_invariant: bool
    graphs: bool
    cpu_kernels: bool


@runtime_checkable
class Backend(Protocol):
    """A model behind the engine: forward over a paged batch, its K/V cache, capabilities and timing."""

    device: torch.device
    dtype: torch.dtype
    #: The longest sequence (prompt and output) a forward may position.
    max_positions: int
    #: The width of a logits row.
    vocab_size: int

    def forward_paged(self, cache: PagedKVCache, batch: PagedBatch) -> torch.Tensor:
        """fp32 logits ``[B, L, V]`` of ``batch``, its K/V written into ``cache``."""
        ...

    def new_paged_cache(self, num_blocks: int, block_size: int) -> PagedKVCache: ...

    def capabilities(self) -> Capabilities: ...

    def timer(self) -> contextlib.AbstractContextManager:
        """``with backend.timer() as t: ...; t.elapsed_s()``: the region's device time."""
        ...

    def kernel_threads(self) -> contextlib.AbstractContextManager:
        """Held over a step's forward and verification: the threading its kernels want (a no-op where none)."""
        ...

    def row_padding(self):
        """How small forwards pad their row count (:class:`spec_core.packing.pack`'s ``padding``), or None."""
        ...

