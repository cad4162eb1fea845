"""Length-grouped forwards: a long prompt chunk no longer pads every short verification in the step to its length."""

from __future__ import annotations

import itertools
import random

import torch

from spec_core.packing import WorkItem, forward_items, pack, split_by_length
from spec_core.runner import ModelRunner


def _cost(groups, lengths, overhead):
    return sum(len(g) * max(lengths[i] for i in g) + overhead for g in groups)


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield part[:i] + [[first, *part[i]]] + part[i + 1:]


def test_a_long_prompt_runs_apart_from_short_verifications():
    lengths = [4] * 15 + [200]
    groups = split_by_length(lengths, overhead=16)
    assert sorted(map(sorted, groups)) == [list(range(15)), [15]]
    assert split_by_length([5] * 16, overhead=16) == [list(range(16))]
    assert len(split_by_length([4, 200], overhead=10_000)) == 1  # a launch-bound device keeps one forward


def test_split_is_an_optimal_partition():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 7)
        lengths = [rng.choice([1, 2, 4, 5, 9, 40, 200]) for _ in range(n)]
        overhead = rng.choice([0, 8, 16, 64])
        groups = split_by_length(lengths, overhead)
        assert sorted(i for g in groups for i in g) == list(range(n))
        best = min(_cost(p, lengths, overhead) for p in _partitions(list(range(n))))
        assert _cost(groups, lengths, overhead) == best, (lengths, overhead, groups)


def test_grouped_forward_equals_one_padded_forward(tiny_models):
    """Same logits (fp32, 1e-4) and same K/V written, whether the items run as one padded batch or in groups."""
    runner = ModelRunner(tiny_models["llama"])
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 3, 40, 1, 5, 17]
    items, base = [], 0
    for n in lengths:
        ids = torch.randint(0, 256, (n,), generator=gen).tolist()
        slots = list(range(base, base + n))
        items.append(WorkItem([], ids, list(range(n)), slots, n, [], list(range(max(0, n - 3), n))))
        base += n
    one = runner.new_paged_cache(16, 8)
    grouped = runner.new_paged_cache(16, 8)
    want = runner.forward_paged(one, pack(items, one.scratch_slot))
    got = forward_items(runner, grouped, items, overhead=0)
    assert len(split_by_length(lengths, 0)) > 1
    assert got.shape == want.shape
    for b, it in enumerate(items):
        rows = len(it.logits_rows)
        assert (got[b, :rows] - want[b, :rows]).abs().max().item() < 1e-4
    used = torch.arange(base)
    for layer in range(len(one.k)):
        assert torch.allclose(one.k[layer][used], grouped.k[layer][used], atol=1e-5)
        assert torch.allclose(one.v[layer][used], grouped.v[layer][used], atol=1e-5)


def test_partitions_helper_counts_bell_numbers():
    assert [sum(1 for _ in _partitions(list(range(n)))) for n in range(1, 6)] == [1, 2, 5, 15, 52]
    assert list(itertools.islice(_partitions([0]), 2)) == [[[0]]]
