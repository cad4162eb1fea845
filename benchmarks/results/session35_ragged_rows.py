"""Session 35: a ragged batch's forward with its pads skipped (``PagedBatch.lengths``) against the same batch padded,
on the default target (bf16 ``auto`` on the AMX Xeon, one thread; medians of 15, interleaved; logits compared bit
for bit).

Printed there (ms, skipped against padded): 16 rows, 14 of 1 token and 2 of 2: 52.81 against 56.67; 12 and 4: 56.4
against 60.47; 4 rows of 1, 4, 2, 1 tokens: 43.01 against 45.43; 4 trees of 7, 3, 1, 4 tokens: 46.13 against 52.95.
All 16 rows at 1 token: 50.67; at 2: 59.39. Every real row's logits were equal.

Run: ``python benchmarks/results/session35_ragged_rows.py``
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from spec_core.config import ModelConfig
from spec_core.model_paths import default_pair
from spec_core.models import load_runner
from spec_core.packing import WorkItem, pack


def _item(ids: list[int], start: int, n: int, slot0: int, parents: tuple[int, ...] = ()) -> WorkItem:
    pending, depth = n - len(parents), []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    pos = list(range(start, start + pending)) + [start + pending - 1 + d for d in depth]
    return WorkItem(list(range(slot0, slot0 + start)), ids[start:start + n], pos,
                    list(range(slot0 + start, slot0 + start + n)), pending, list(parents), list(range(n)))


def main() -> None:
    torch.set_num_threads(1)
    runner = load_runner(ModelConfig(default_pair()["target"], "auto"))
    ids = torch.randint(0, 40000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = 80
    cache = runner.new_paged_cache(168, 16)
    for b in range(16):
        runner.forward_paged(cache, pack([_item(ids, 0, prompt, b * 160)], cache.scratch_slot))
    chain = lambda n: tuple([-1] + list(range(n - 2)))  # noqa: E731 (a chain's parents after one pending token)
    shapes = {
        "16 rows, 14x1 + 2x2": [_item(ids, prompt, 2 if b < 2 else 1, b * 160) for b in range(16)],
        "16 rows, 12x1 + 4x2": [_item(ids, prompt, 2 if b < 4 else 1, b * 160) for b in range(16)],
        "16 rows of 2": [_item(ids, prompt, 2, b * 160) for b in range(16)],
        "16 rows of 1": [_item(ids, prompt, 1, b * 160) for b in range(16)],
        "4 rows of 1, 4, 2, 1": [_item(ids, prompt, n, b * 160) for b, n in enumerate((1, 4, 2, 1))],
        "4 trees of 7, 3, 1, 4": [_item(ids, prompt, n, b * 160, chain(n)) for b, n in enumerate((7, 3, 1, 4))],
    }
    for name, items in shapes.items():
        batch = pack(items, cache.scratch_slot, row_padding=runner.row_padding())
        variants = {"skipped": batch}
        if batch.lengths is not None:
            variants["padded"] = dataclasses.replace(batch, lengths=None)
        outs = {k: runner.forward_paged(cache, v) for k, v in variants.items()}
        same = all(torch.equal(outs["skipped"][b, :len(it.token_ids)], outs["padded"][b, :len(it.token_ids)])
                   for b, it in enumerate(items)) if len(outs) == 2 else None
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(15):
            for k, v in variants.items():
                t0 = time.perf_counter()
                runner.forward_paged(cache, v)
                times[k].append(time.perf_counter() - t0)
        medians = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
        print(f"{name:24s} {medians} logits equal: {same}")


if __name__ == "__main__":
    main()
