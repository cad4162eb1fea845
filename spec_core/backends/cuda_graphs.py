"""CUDA graphs over the static-buffer step: one graph per bucket, captured on first use, replayed from the buffers.

Planning stays outside the graph: the batch is packed and copied into its bucket's buffers
(:class:`~spec_core.backends.static_step.StaticBuffers`), then the graph replays the whole forward (embedding,
layers, attention with the mask buffer, logits). A context length not seen before reuses its bucket's graph, so it
costs what a seen one costs.

Invariants:
  * a graph reads the addresses of one cache's K/V pool and one bucket's buffers: a step serves one cache;
  * warm-up and capture run over the padding state (every write goes to the scratch slot), so capturing changes
    no request's K/V;
  * replays share one memory pool and reuse their outputs, so the returned logits are a copy.

Importing this module touches no CUDA state; a step is built only for a CUDA cache (:func:`graph_step`).
"""

from __future__ import annotations

import logging
import time

import torch

from spec_core.backends.static_step import Buckets, PagedForward, StaticBuffers, StaticStep, logits_rows
from spec_core.kv_cache import PagedBatch, PagedKVCache

logger = logging.getLogger(__name__)

#: Eager runs on a side stream before a capture (cuBLAS and attention pick and allocate their workspaces there).
WARMUP_RUNS = 2


def require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA cache, not {device}")


class CudaGraphStep:
    """``step(cache, batch)``: the static step's logits ``[B, L, V]`` by graph replay (see the module invariants).
    A batch past the largest bucket, or over another cache, runs the eager ``forward``."""

    def __init__(self, forward: PagedForward, cache: PagedKVCache, buckets: Buckets | None = None) -> None:
        device = cache.kv.device
        require_cuda(device)
        self.forward = forward
        self.cache = cache
        self.static = StaticStep(forward, cache.scratch_slot, device, buckets)
        self.graphs: dict[tuple[int, int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        #: Seconds each capture took, by bucket.
        self.capture_s: dict[tuple[int, int, int, int], float] = {}
        #: Buckets whose capture failed; they run the eager forward.
        self.eager: set[tuple[int, int, int, int]] = set()

    def capture(self, buf: StaticBuffers) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the forward over ``buf`` (left in the padding state; the caller reloads its batch)."""
        t0 = time.perf_counter()
        buf.load_padding()
        side = torch.cuda.Stream(device=self.cache.kv.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.forward(self.cache, buf.batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(self.cache, buf.batch)
        self.pool = graph.pool()
        torch.cuda.synchronize()
        self.capture_s[buf.key] = time.perf_counter() - t0
        logger.info("captured bucket %s in %.0f ms", buf.key, self.capture_s[buf.key] * 1e3)
        return graph, out

    def __call__(self, cache: PagedKVCache, batch: PagedBatch) -> torch.Tensor:
        if cache is not self.cache or not self.static.buckets.fits(batch):
            return self.forward(cache, batch)
        buf = self.static.buffers_for(batch)
        if buf.key in self.eager:
            return self.forward(cache, batch)
        entry = self.graphs.get(buf.key)
        if entry is None:
            try:
                entry = self.graphs[buf.key] = self.capture(buf)
            except RuntimeError as exc:  # a forward that cannot be captured (a host sync in it) runs eagerly
                logger.warning("bucket %s runs eagerly: its capture failed (%s)", buf.key, exc)
                self.eager.add(buf.key)
                return self.forward(cache, batch)
            buf.load(batch)
        graph, out = entry
        graph.replay()
        return out[: batch.input_ids.shape[0], : logits_rows(batch)].clone()


def graph_step(forward: PagedForward, cache: PagedKVCache, buckets: Buckets | None = None) -> CudaGraphStep:
    """A :class:`CudaGraphStep` over ``cache`` (which must live on a CUDA device)."""
    return CudaGraphStep(forward, cache, buckets)
