"""Pack per-request work into one ragged :class:`PagedBatch`, and reconcile K/V after verification.

Slot layout of one request whose committed K/V covers positions ``[0, c)`` and whose pending tokens are
``x[c..n-1]`` (the last one, ``x[n-1]``, is the root of this round's speculation):
  * pending token at position p → slot of position p (contiguous, in the request's own blocks);
  * speculation node i (depth d_i ≥ 1) → position ``n - 1 + d_i``, slot of position ``n + i``.
A chain's node i has depth i + 1, so its slot is already its position's slot. For a tree, after verification the
accepted path's nodes are copied to the slots of positions ``n, n+1, ...`` (:func:`reconcile_tree_slots`) and
everything else is discarded by truncating to the new committed length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from spec_core.kv_cache import PagedBatch, PagedKVCache
from spec_core.transfer import to_device


class RowPolicy(Protocol):
    """How a forward of ``rows`` rows pads its tokens per row
    (:class:`spec_core.backends.cpu.row_padding.RowPadding`)."""

    def tokens(self, rows: int, tokens: int) -> int: ...

    def skip_pads(self, real: int, padded: int) -> bool: ...


class PagedModel(Protocol):
    """What packing needs of a model: a :class:`~spec_core.backends.Backend` or a bare runner."""

    device: torch.device

    def forward_paged(self, cache: PagedKVCache, batch: PagedBatch) -> torch.Tensor: ...

    def row_padding(self) -> RowPolicy | None: ...


@dataclass(slots=True)
class WorkItem:
    """One request's share of a forward pass.

    Attributes:
        prefix_slots: committed slots every new token attends.
        token_ids / positions / write_slots: the new tokens (pending tokens, then speculation nodes).
        num_pending: how many of the new tokens are pending (causal among themselves); the rest are nodes.
        parents: parent of each node (index among the nodes; -1 = the last pending token).
        logits_rows: indices into the new tokens whose logits are wanted.
        extra_slots / extra_mask: slots written by earlier forwards of this round (tree nodes being extended),
            with ``extra_mask [T, E]`` (a host tensor) saying which new token sees which (its ancestors).
    """

    prefix_slots: list[int]
    token_ids: list[int]
    positions: list[int]
    write_slots: list[int]
    num_pending: int
    parents: list[int]
    logits_rows: list[int]
    extra_slots: list[int] = field(default_factory=list)
    extra_mask: torch.Tensor | None = None


@functools.lru_cache(maxsize=1024)
def new_token_mask(num_pending: int, parents: tuple[int, ...]) -> np.ndarray:
    """``[T, T]`` bool: causal among pending tokens; each node sees all pending tokens, itself and its ancestors.
    Cached by shape (a step's items share a few), so the array is read-only."""
    t = num_pending + len(parents)
    mask = np.zeros((t, t), dtype=bool)
    mask[:num_pending, :num_pending] = np.tri(num_pending, dtype=bool)
    for i, parent in enumerate(parents):
        row = num_pending + i
        mask[row, :num_pending] = True
        if parent >= 0:
            mask[row] |= mask[num_pending + parent]
        mask[row, row] = True
    mask.flags.writeable = False
    return mask


def pack(items: list[WorkItem], scratch_slot: int, device: torch.device | str = "cpu",
         row_padding: RowPolicy | None = None) -> PagedBatch:
    """Build the padded tensors for :meth:`ModelRunner.forward_paged`, with one upload.

    The integer fields and the attention mask are staged on the host in one byte buffer (int64 fields first, then the
    bool mask) that crosses to the device in a single copy; the device views it back into fields. A mask that hides
    nothing is left out. Pad tokens (ragged rows, and ``row_padding``'s extra tokens and logits rows, see
    :mod:`spec_core.backends.cpu.row_padding`) write to ``scratch_slot``, may attend to every slot and are never read.
    The host side is numpy and Python lists (a torch op per field and item cost more than the rest of a decode step's
    bookkeeping).
    """
    bsz = len(items)
    lens = [len(it.token_ids) for it in items]
    t_max = max(lens)
    s_max = max(len(it.prefix_slots) + len(it.extra_slots) + len(it.token_ids) for it in items)
    l_max = max(1, max(len(it.logits_rows) for it in items))
    if row_padding is not None:
        t_max, l_max = row_padding.tokens(bsz, t_max), row_padding.tokens(bsz, l_max)
    real = sum(lens)
    ragged = real < bsz * t_max and (row_padding is None or row_padding.skip_pads(real, bsz * t_max))
    # input_ids, positions, write_slots, kv_slots, logits_index, and each row's real tokens where the kernels may
    # skip its pads (PagedBatch.lengths)
    widths = (t_max, t_max, t_max, s_max, l_max, int(ragged))
    rows = []
    mask = np.zeros((bsz, t_max, s_max), dtype=bool)
    for b, it in enumerate(items):
        t, p, e = len(it.token_ids), len(it.prefix_slots), len(it.extra_slots)
        pad, kv = t_max - t, p + e + t
        rows.append([*it.token_ids, *[0] * pad, *it.positions, *[0] * pad, *it.write_slots, *[scratch_slot] * pad,
                     *it.prefix_slots, *it.extra_slots, *it.write_slots, *[scratch_slot] * (s_max - kv),
                     *it.logits_rows, *[0] * (l_max - len(it.logits_rows)), *[t] * ragged])
        mask[b, :t, :p] = True
        if e:
            mask[b, :t, p : p + e] = it.extra_mask.numpy()  # a host tensor (WorkItem)
        mask[b, :t, p + e : kv] = new_token_mask(it.num_pending, tuple(it.parents))
        mask[b, t:] = True  # pad queries see every slot (softmax stays finite, the mask may stay all-True); unused
    ints = np.array(rows, dtype=np.int64)
    n_int = ints.nbytes
    if mask.all():
        mask = mask[:0]
    staged = torch.from_numpy(np.concatenate([ints.reshape(-1).view(np.uint8), mask.reshape(-1).view(np.uint8)]))
    buf = to_device(staged, device)
    fields = buf[:n_int].view(torch.long).view(bsz, -1).split(widths, dim=1)
    return PagedBatch(
        input_ids=fields[0],
        positions=fields[1],
        write_slots=fields[2].contiguous(),
        kv_slots=fields[3].contiguous(),
        attn_mask=buf[n_int:].view(torch.bool).view(bsz, t_max, s_max) if mask.size else None,
        logits_index=fields[4],
        lengths=fields[5].reshape(-1).contiguous() if ragged else None,
    )


def split_by_length(lengths: list[int], overhead: int) -> list[list[int]]:
    """Partition item indices into forward groups minimising padded work: Σ_g (items_g · longest_g) + overhead · groups.

    A padded batch costs every row the longest row's tokens, so one 200-token prompt joining fifteen 4-token
    verifications would make all sixteen rows 200 tokens long. ``overhead`` is a forward's fixed cost in tokens.
    Optimal over contiguous runs of the length-sorted items (dynamic programming over distinct lengths).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    runs: list[list[int]] = []  # items of equal length stay together
    for i in order:
        if runs and lengths[runs[-1][0]] == lengths[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    m = len(runs)
    best = [0.0] + [float("inf")] * m  # best[j]: cost of runs[:j]
    cut = [0] * (m + 1)
    for j in range(1, m + 1):
        count = 0
        for i in range(j, 0, -1):  # the last group is runs[i-1 : j]
            count += len(runs[i - 1])
            c = best[i - 1] + count * lengths[runs[j - 1][0]] + overhead
            if c < best[j]:
                best[j], cut[j] = c, i - 1
    groups, j = [], m
    while j > 0:
        groups.append([x for r in runs[cut[j]:j] for x in r])
        j = cut[j]
    return groups[::-1]


def default_group_overhead(device: torch.device) -> int:
    """A forward's fixed cost in tokens: small on CPUs (cost grows with tokens), large on GPUs (launch-bound)."""
    return 16 if device.type == "cpu" else 512


def forward_items(model: PagedModel, cache: PagedKVCache, items: list[WorkItem],
                  overhead: int | None = None) -> torch.Tensor:
    """``model.forward_paged`` over ``items``, split into groups of similar length (:func:`split_by_length`);
    the same result as one packed forward: logits ``[B, L, V]`` (rows of an item past its ``logits_rows`` are
    padding). Items touch disjoint slots, so the groups may run one after another."""
    if overhead is None:
        overhead = default_group_overhead(model.device)
    groups = split_by_length([len(it.token_ids) for it in items], overhead)
    if len(groups) == 1:
        return model.forward_paged(cache, pack(items, cache.scratch_slot, model.device, model.row_padding()))
    l_max = max(1, max(len(it.logits_rows) for it in items))
    out = None
    for g in groups:
        logits = model.forward_paged(cache, pack([items[i] for i in g], cache.scratch_slot, model.device,
                                                 model.row_padding()))
        if out is None:
            out = logits.new_zeros(len(items), l_max, logits.shape[-1])
        out[to_device(g, logits.device, torch.long), : logits.shape[1]] = logits[:, :l_max]
    return out


def reconcile_tree_slots(slots_of_position, n: int, path: list[int]) -> tuple[list[int], list[int]]:
    """(src, dst) slot lists that move the accepted nodes' K/V to positions ``n, n+1, ...``.

    ``slots_of_position(start, end)`` maps positions to the request's slots; node i was written at the slot of
    position ``n + i``.
    """
    if not path:
        return [], []
    src = [slots_of_position(n + i, n + i + 1)[0] for i in path]
    dst = slots_of_position(n, n + len(path))
    moves = [(s, d) for s, d in zip(src, dst) if s != d]
    return [s for s, _ in moves], [d for _, d in moves]
