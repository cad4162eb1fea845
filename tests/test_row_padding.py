"""Row padding (:mod:`spec_core.backends.cpu.row_padding`): a forward of few tokens runs as more rows where the runner
measured its weight matmuls faster, without changing the real rows' logits or K/V."""

from __future__ import annotations

import torch

from spec_core.backends.cpu.row_padding import RowPadding, measure
from spec_core.packing import WorkItem, forward_items, pack
from spec_core.runner import ModelRunner

#: The shape measured on the 2-vCPU AVX-512 BF16 VM (SmolLM2-135M bf16, ms by rows 1..8): 1 and 2 rows slow.
MEASURED = RowPadding(tuple(t / 1e3 for t in (20.2, 23.1, 18.7, 17.7, 17.9, 18.1, 21.5, 24.7)))


def test_tokens_pads_to_the_fastest_measured_size_past_the_margin():
    assert [MEASURED.tokens(1, t) for t in range(1, 10)] == [4, 4, 4, 4, 5, 6, 7, 8, 9]  # 3 → 4: 5.3% faster
    assert MEASURED.padded_sizes() == {1: 4, 2: 4, 3: 4}
    assert RowPadding(MEASURED.seconds, margin=0.06).padded_sizes() == {1: 4, 2: 4}
    assert MEASURED.tokens(2, 1) == 2  # 2 rows of 1 token run as 2 rows of 2 (4 rows)
    assert MEASURED.tokens(3, 1) == 1  # 3 rows: 6 rows would be 3.2% faster, under the margin
    assert MEASURED.tokens(16, 1) == 1  # past the table: as is
    flat = RowPadding(tuple([0.02] * 8))
    assert all(flat.tokens(1, t) == t for t in range(1, 9))  # a tie never pads
    assert RowPadding(MEASURED.seconds, margin=0.5).padded_sizes() == {}


def test_measure_times_the_stack_at_every_row_count(tiny_models):
    runner = ModelRunner(tiny_models["llama"], dtype=torch.bfloat16, pad_rows=False)
    assert runner.row_padding() is None
    pad = measure(runner.weight_matrices(), runner.dtype, runner.device, repeats=2)
    assert len(pad.seconds) == 8 and all(s > 0 for s in pad.seconds)
    assert ModelRunner(tiny_models["llama"]).row_padding() is None  # the fp32 reference is never padded
    padded = ModelRunner(tiny_models["llama"], dtype=torch.bfloat16)
    assert padded.row_paddings == {}  # measured on first use, per thread count
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = padded.row_padding()
        assert one is padded.row_padding() and list(padded.row_paddings) == [1]
    finally:
        torch.set_num_threads(threads)


def _items(gen: torch.Generator) -> tuple[list[WorkItem], list[WorkItem]]:
    """A prompt per request, then a one-token decode and a 2-node tree verify after it."""
    prompts, steps = [], []
    for r, n in enumerate((7, 12)):
        base = r * 32
        ids = torch.randint(0, 256, (n + 3,), generator=gen).tolist()
        prompts.append(WorkItem([], ids[:n], list(range(n)), list(range(base, base + n)), n, [], [n - 1]))
        if r == 0:
            steps.append(WorkItem(list(range(base, base + n)), [ids[n]], [n], [base + n], 1, [], [0]))
        else:  # root, then two siblings at depth 1
            steps.append(WorkItem(list(range(base, base + n)), ids[n:n + 3], [n, n + 1, n + 1],
                                  [base + n, base + n + 1, base + n + 2], 1, [-1, -1], [0, 1, 2]))
    return prompts, steps


def test_padded_forwards_give_the_real_rows_the_same_logits_and_kv(tiny_models):
    """bf16: the same logits bit for bit, one request or two, whether the step runs as its own rows or padded to
    more; the pad tokens' K/V lands in the scratch slot only."""
    runner = ModelRunner(tiny_models["llama"], dtype=torch.bfloat16)
    runner.row_paddings[torch.get_num_threads()] = RowPadding(tuple([0.02] * 3 + [0.01] * 5))  # below 4 rows: 4
    for which in ([0], [1], [0, 1]):
        outs, pools = [], []
        for pad in (False, True):
            runner.pad_rows = pad
            cache = runner.new_paged_cache(8, 16)
            prompts, steps = _items(torch.Generator().manual_seed(5))
            forward_items(runner, cache, [prompts[i] for i in which])
            outs.append(forward_items(runner, cache, [steps[i] for i in which]))
            pools.append([kv[: cache.scratch_slot].clone() for kv in cache.kv])
        plain, padded = outs
        for b, i in enumerate(which):
            rows = len(_items(torch.Generator().manual_seed(5))[1][i].logits_rows)
            assert torch.equal(plain[b, :rows], padded[b, :rows]), which
        assert all(torch.equal(a, c) for a, c in zip(*pools))


def test_pack_pads_tokens_and_logits_rows_to_the_scratch_slot():
    item = WorkItem([0, 1, 2], [9], [3], [3], 1, [], [0])
    batch = pack([item], scratch_slot=99, row_padding=MEASURED)
    assert batch.input_ids.shape == (1, 4) and batch.logits_index.shape == (1, 4)
    assert batch.write_slots.tolist() == [[3, 99, 99, 99]]
    assert batch.attn_mask is None  # the real token sees every slot and so do the pads: no mask to apply
    assert pack([item], scratch_slot=99).input_ids.shape == (1, 1)
