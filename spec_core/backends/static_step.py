"""A paged forward over preallocated, bucket-shaped buffers: what a CUDA graph captures and replays.

A step copies a :class:`~spec_core.kv_cache.PagedBatch` into the buffers of its bucket (batch rows, tokens per row,
attended slots, logits rows; see :class:`Buckets`), runs the same forward over the padded buffers and returns the
real rows' logits. On a CPU it runs without capture; :mod:`spec_core.backends.cuda_graphs` captures it per bucket.

Padding invariants (what keeps every real token's logits and K/V those of the dynamic forward):
  * pad rows and pad tokens write the cache's scratch slot, which no request owns and no real query attends;
  * pad slot columns read the scratch slot and are masked off for every real query (``exp(-inf) = 0`` exactly);
  * every pad query sees slot column 0, so its softmax stays finite; its output is never read;
  * pad logits rows point at token 0 of their row and are cut off before the logits are returned.
The slot table ``kv_slots`` is the block table expanded to slots (the runner attends a gathered slot list).

Exactness (fp32, CPU, ``tests/test_static_step.py``). Padding rows and tokens changes no real row's bits, given
:data:`SMALL`. Padding slot columns can: the attention reduces over the key axis in groups that depend on the key
count, so masked extra keys may move a logit by a few 1e-6. The dynamic step pads a short row beside a longer one
the same way, so a step equals, bit for bit, the dynamic forward of its batch widened to the bucket's slot count,
and with ``context_step=1`` the plain dynamic forward.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spec_core.kv_cache import PagedBatch, PagedKVCache

logger = logging.getLogger(__name__)

#: ``forward(cache, batch) -> logits [B, L, V]``: a paged forward, such as ``ModelRunner.forward_paged``.
PagedForward = Callable[[PagedKVCache, PagedBatch], torch.Tensor]


#: The smallest buckets: every count up to 4. BLAS multiplies fewer than 4 rows with another kernel than 4 or more
#: (on a CPU in fp32, 3 rows padded to 4 change the low bits of every row; 5 padded to 8 change none), so a product
#: of 1-3 real rows (batch x tokens) keeps its own row count and kernel.
SMALL = (1, 2, 3, 4)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes 1, 2, 3, 4, 8, then every 16, up to (and covering) ``max_batch``."""
    sizes = [*SMALL, 8] + list(range(16, max_batch + 16, 16))
    return tuple(sizes[: next(i for i, s in enumerate(sizes) if s >= max_batch) + 1])


def power_buckets(limit: int) -> tuple[int, ...]:
    """Tokens per row: 1, 2, 3, 4, then powers of two up to the first covering ``limit``."""
    sizes = list(SMALL)
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    return tuple(s for s in sizes if s < limit) + (next(s for s in sizes if s >= limit),)


def _fit(sizes: tuple[int, ...], n: int, what: str) -> int:
    i = bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{what} {n} exceeds the largest bucket {sizes[-1]}")
    return sizes[i]


def logits_rows(batch: PagedBatch) -> int:
    """How many logits rows each of ``batch``'s rows returns."""
    return batch.input_ids.shape[1] if batch.logits_index is None else batch.logits_index.shape[1]


@dataclass(frozen=True)
class Buckets:
    """The shapes a step pads to: batch rows, tokens per row (and logits rows), attended slots.

    ``context_step``: attended slots round up to a multiple of it, so a context length not seen before reuses the
    buffers (and, on a GPU, the graph) of its multiple.
    """

    max_batch: int = 64
    max_tokens: int = 16
    max_context: int = 2048
    context_step: int = 256
    batch: tuple[int, ...] = field(init=False)
    tokens: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch", batch_buckets(self.max_batch))
        object.__setattr__(self, "tokens", power_buckets(self.max_tokens))

    def context(self, s: int) -> int:
        if s > self.max_context:
            raise ValueError(f"context {s} exceeds max_context {self.max_context}")
        return min(-(-s // self.context_step) * self.context_step, self.max_context)

    def fits(self, batch: PagedBatch) -> bool:
        """Whether ``batch`` fits the largest bucket (a longer prefill runs the dynamic forward)."""
        bsz, t = batch.input_ids.shape
        return (bsz <= self.batch[-1] and max(t, logits_rows(batch)) <= self.tokens[-1]
                and batch.kv_slots.shape[1] <= self.max_context)

    def key(self, batch: PagedBatch) -> tuple[int, int, int, int]:
        """``(rows, tokens, slots, logits rows)`` of the bucket ``batch`` fits in."""
        bsz, t = batch.input_ids.shape
        return (_fit(self.batch, bsz, "batch"), _fit(self.tokens, t, "tokens per row"),
                self.context(batch.kv_slots.shape[1]), _fit(self.tokens, logits_rows(batch), "logits rows"))


class StaticBuffers:
    """One bucket's input buffers, a :class:`PagedBatch` whose tensors never move (a graph reads their addresses)."""

    def __init__(self, key: tuple[int, int, int, int], scratch_slot: int, device: torch.device) -> None:
        b, t, s, lrows = key
        self.key, self.scratch_slot = key, scratch_slot

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.batch = PagedBatch(input_ids=ints(b, t), positions=ints(b, t), write_slots=ints(b, t),
                                kv_slots=ints(b, s), attn_mask=torch.zeros(b, t, s, dtype=torch.bool, device=device),
                                logits_index=ints(b, lrows), lengths=None)
        self.load_padding()

    def load_padding(self) -> None:
        """Every entry a pad: ids and positions 0, writes and reads at scratch, each query sees column 0 only."""
        sb = self.batch
        sb.input_ids.zero_()
        sb.positions.zero_()
        sb.write_slots.fill_(self.scratch_slot)
        sb.kv_slots.fill_(self.scratch_slot)
        sb.attn_mask.zero_()
        sb.attn_mask[:, :, 0] = True
        sb.logits_index.zero_()

    def load(self, batch: PagedBatch) -> None:
        """Copy ``batch`` into the leading corner of the buffers and pad the rest (see the module invariants)."""
        bsz, t = batch.input_ids.shape
        s = batch.kv_slots.shape[1]
        self.load_padding()
        sb = self.batch
        sb.input_ids[:bsz, :t].copy_(batch.input_ids)
        sb.positions[:bsz, :t].copy_(batch.positions)
        sb.write_slots[:bsz, :t].copy_(batch.write_slots)
        sb.kv_slots[:bsz, :s].copy_(batch.kv_slots)
        real = sb.attn_mask[:bsz, :t, :s]
        if batch.attn_mask is None:
            real.fill_(True)
        else:
            real.copy_(batch.attn_mask)
        if batch.logits_index is None:
            sb.logits_index[:bsz, :t].copy_(torch.arange(t, device=sb.logits_index.device))
        else:
            sb.logits_index[:bsz, : batch.logits_index.shape[1]].copy_(batch.logits_index)


class StaticStep:
    """``forward`` over bucket-shaped buffers: ``step(cache, batch)`` returns the dynamic forward's logits
    ``[B, L, V]`` and writes the same K/V to the real slots (the scratch slot aside)."""

    def __init__(self, forward: PagedForward, scratch_slot: int, device: torch.device | str,
                 buckets: Buckets | None = None) -> None:
        self.forward = forward
        self.scratch_slot = scratch_slot
        self.device = torch.device(device)
        self.buckets = buckets or Buckets()
        self.buffers: dict[tuple[int, int, int, int], StaticBuffers] = {}

    def buffers_for(self, batch: PagedBatch) -> StaticBuffers:
        """The buffers of ``batch``'s bucket (allocated on first use), loaded with ``batch``."""
        key = self.buckets.key(batch)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = StaticBuffers(key, self.scratch_slot, self.device)
            logger.debug("static buffers for bucket %s", key)
        buf.load(batch)
        return buf

    def __call__(self, cache: PagedKVCache, batch: PagedBatch) -> torch.Tensor:
        if not self.buckets.fits(batch):
            return self.forward(cache, batch)
        buf = self.buffers_for(batch)
        logits = self.forward(cache, buf.batch)
        return logits[: batch.input_ids.shape[0], : logits_rows(batch)]
