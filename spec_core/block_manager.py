"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, per-sequence block tables.

The physical cache is a pool of ``num_blocks * block_size`` slots (see :class:`spec_core.runner.PagedKVCache`);
slot ``b * block_size + i`` is offset ``i`` of block ``b``. This class only decides which slots a sequence owns.

Invariants:
  * a block is on the free list iff its reference count is 0;
  * ``num_valid(seq)`` counts the sequence's committed tokens; slots past it hold speculative or stale K/V and
    are never attended as prefix (the attention mask covers committed slots plus the current step's new tokens);
  * :meth:`truncate` after a verification drops every block wholly past the accepted length, so a block that holds
    only rejected tokens returns to the pool, and a partly valid block is overwritten from its first invalid slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler preempts or waits."""


@dataclass(slots=True)
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    num_valid: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, BlockTable] = {}

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_valid(self, seq_id: str) -> int:
        return self.tables[seq_id].num_valid

    def capacity(self, seq_id: str) -> int:
        return len(self.tables[seq_id].blocks) * self.block_size

    def extra_blocks_needed(self, seq_id: str | None, total_tokens: int) -> int:
        have = len(self.tables[seq_id].blocks) if seq_id in self.tables else 0
        return max(0, self.blocks_for(total_tokens) - have)

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """Physical slots of token positions ``[start, end)`` of the sequence (must be allocated)."""
        table, bs = self.tables[seq_id].blocks, self.block_size
        assert end <= len(table) * bs, f"{seq_id}: slots up to {end} but only {len(table) * bs} allocated"
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    # ---- mutations -----------------------------------------------------------------------------------------
    def ensure(self, seq_id: str, total_tokens: int) -> None:
        """Grow the sequence's table to hold ``total_tokens`` slots; all or nothing."""
        table = self.tables.setdefault(seq_id, BlockTable())
        need = self.blocks_for(total_tokens) - len(table.blocks)
        if need > len(self.free_blocks):
            if not table.blocks:
                del self.tables[seq_id]
            raise NoFreeBlocks(f"{seq_id}: need {need} blocks, {len(self.free_blocks)} free")
        for _ in range(max(0, need)):
            block = self.free_blocks.pop()
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
            table.blocks.append(block)

    def commit(self, seq_id: str, num_valid: int) -> None:
        """Mark ``num_valid`` tokens as committed (accepted), then drop blocks past them."""
        table = self.tables[seq_id]
        assert num_valid <= len(table.blocks) * self.block_size
        table.num_valid = num_valid
        self.truncate(seq_id, num_valid)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Release blocks wholly past ``num_tokens``."""
        table = self.tables[seq_id]
        keep = self.blocks_for(num_tokens)
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())
        table.num_valid = min(table.num_valid, num_tokens)

    def fork(self, src: str, dst: str) -> None:
        """Share ``src``'s committed full blocks with a new sequence ``dst`` (reference counted)."""
        table = self.tables[src]
        full = table.num_valid // self.block_size
        shared = table.blocks[:full]
        for block in shared:
            self.ref_counts[block] += 1
        self.tables[dst] = BlockTable(blocks=list(shared), num_valid=full * self.block_size)

    def free(self, seq_id: str) -> None:
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        for block in table.blocks:
            self._release(block)

    def _release(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"double free of block {block}"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    def check_all_free(self) -> None:
        """Assert the pool is whole (used by tests and at shutdown)."""
        assert not self.tables, f"sequences still hold blocks: {sorted(self.tables)}"
        assert self.num_free == self.num_blocks and not any(self.ref_counts)
