"""A request's share of a forward (:class:`spec_core.packing.WorkItem`) for kernel and packing tests."""

from __future__ import annotations

from spec_core.packing import WorkItem


def work_item(ids: list[int], start: int, n: int, slot0: int, parents: tuple[int, ...] = ()) -> WorkItem:
    """Row of ``n`` new tokens ``ids[start:start + n]`` after ``start`` committed ones, at slots from ``slot0``;
    ``parents`` makes its last ``len(parents)`` tokens tree nodes. Every token's logits are wanted."""
    pending, depth = n - len(parents), []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    pos = list(range(start, start + pending)) + [start + pending - 1 + d for d in depth]
    return WorkItem(prefix_slots=list(range(slot0, slot0 + start)), token_ids=ids[start:start + n], positions=pos,
                    write_slots=list(range(slot0 + start, slot0 + start + n)), num_pending=pending,
                    parents=list(parents), logits_rows=list(range(n)))
