"""The K/V stores the runner writes and attends: a contiguous per-row cache (training, test references) and the
paged slot pool every engine uses, plus the packed ragged batch that addresses it (see :mod:`spec_core.packing`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from spec_core.transfer import to_device

if TYPE_CHECKING:
    from spec_core.arch import ArchSpec


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On a CPU its pages are the kernel's zero pages until first written (``calloc``), so a pool
    sized for many long requests costs resident memory only for the slots requests have used."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVCache:
    """Preallocated K/V tensors: ``[num_layers, max_rows, num_kv_heads, max_len, head_dim]`` each."""

    def __init__(self, spec: ArchSpec, max_rows: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (spec.num_layers, max_rows, spec.num_kv_heads, max_len, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_rows = max_rows
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class PagedKVCache:
    """A pool of K/V slots: ``kv [num_layers, num_blocks * block_size + 1, 2 * num_kv_heads, head_dim]``, a slot's
    K heads then its V heads, so one layer writes and gathers its K/V with one copy each (``k`` and ``v`` are views).

    The extra last slot is scratch: padded batch entries write there and are never attended.
    """

    def __init__(self, spec: ArchSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_slots = num_blocks * block_size
        self.num_kv_heads = spec.num_kv_heads
        shape = (spec.num_layers, self.num_slots + 1, 2 * spec.num_kv_heads, spec.head_dim)
        self.kv = zeroed(shape, dtype, device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, :, : self.num_kv_heads]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, :, self.num_kv_heads :]

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Move K/V between slots (KV reconciliation after a tree verification)."""
        if src == dst:
            return
        s, d = to_device([src, dst], self.kv.device, torch.long)
        self.kv[:, d] = self.kv[:, s]


@dataclass(slots=True)
class PagedBatch:
    """A packed ragged batch for :meth:`ModelRunner.forward_paged`; padding is explicit.

    input_ids, positions, write_slots: ``[B, T]`` (pad entries write the scratch slot).
    kv_slots: ``[B, S]`` physical slots each row attends, in any order (pad = scratch).
    attn_mask: ``[B, T, S]`` bool; every query row must see at least one slot (pads see their own scratch). None
        when every query sees every slot (decode rows of equal length): attention then skips the mask.
    logits_index: ``[B, T']`` rows of T whose logits are returned (None = all).
    lengths: ``[B]`` each row's real tokens (the first ones of its T), where the rows differ and the CPU kernels
        may skip the pad tokens (:func:`spec_core.backends.cpu.cpu_kernels.run_paged`); None = run all B · T. It changes
        no real token's result, only what the pads cost.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    kv_slots: torch.Tensor
    attn_mask: torch.Tensor | None
    logits_index: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
