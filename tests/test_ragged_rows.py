"""Ragged rows (:attr:`spec_core.kv_cache.PagedBatch.lengths`): a batch whose rows have different token counts
runs only its real tokens through the CPU kernels, and every real token's logits and K/V are those of the padded
batch, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_row_padding import MEASURED  # 4 rows measured fastest
from work_items import work_item

from spec_core.backends.cpu import cpu_kernels
from spec_core.packing import pack
from spec_core.runner import ModelRunner


def test_pack_marks_rows_ragged_where_skipping_the_pads_is_faster():
    ids = list(range(100))
    one, two, three = (work_item(ids, 10, n, 0) for n in (1, 2, 3))
    assert pack([one, one], 999).lengths is None  # equal rows: nothing to skip
    assert pack([one, three, two], 999).lengths.tolist() == [1, 3, 2]  # no table: always skip
    assert pack([one, two], 999, row_padding=MEASURED).lengths is None  # 4 padded rows measured faster than 3
    assert pack([one, three], 999, row_padding=MEASURED).lengths.tolist() == [1, 3]  # 4 rows faster than 6
    assert pack([one] * 14 + [two] * 2, 999, row_padding=MEASURED).lengths.tolist() == [1] * 14 + [2] * 2
    assert MEASURED.skip_pads(4, 6) and not MEASURED.skip_pads(3, 4) and MEASURED.skip_pads(18, 32)


def _runners(toy_pair):
    yield "bf16", ModelRunner(toy_pair["target"], dtype=torch.bfloat16, pad_rows=False)
    fp32 = ModelRunner(toy_pair["target"])  # the fp32 reference never takes the kernels: put in by hand
    fp32.kernels, fp32.rope_f32 = cpu_kernels.load(torch.float32), fp32._rope_tables()
    yield "fp32", fp32
    if cpu_kernels.quant_gemm() is not None:
        int4 = ModelRunner(toy_pair["target"], weights="int4")
        assert int4.fused is not None  # the one-call decoder (decoder.c)
        yield "int4", int4


@pytest.mark.skipif(cpu_kernels.load(torch.float32) is None, reason="the CPU kernels cannot be built here")
def test_a_ragged_batch_gives_the_padded_batchs_floats(toy_pair):
    """Decode rows, a verify row and a tree row, after a prefill: skipping the pads changes no real token's logits
    or K/V (bf16, fp32 through the kernels, and int4 through the one-call decoder)."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 1000, (64,), generator=gen).tolist()
    prefill = [work_item(ids, 0, 20, 0), work_item(ids, 0, 24, 32), work_item(ids, 0, 22, 64), work_item(ids, 0, 21, 96)]
    step = [work_item(ids, 20, 1, 0), work_item(ids, 24, 4, 32), work_item(ids, 22, 1, 64),
            work_item(ids, 21, 6, 96, parents=(-1, -1, 0, 0, 1))]
    seen = []
    for name, runner in _runners(toy_pair):
        seen.append(name)
        outs = []
        for ragged in (True, False):
            cache = runner.new_paged_cache(16, 8)
            runner.forward_paged(cache, pack(prefill, cache.scratch_slot))
            batch = pack(step, cache.scratch_slot)
            assert batch.lengths is not None
            logits = runner.forward_paged(cache, batch if ragged else dataclasses.replace(batch, lengths=None))
            live = [s for s in range(cache.kv.shape[1]) if s != cache.scratch_slot]
            outs.append(([logits[b, : len(it.token_ids)] for b, it in enumerate(step)], cache.kv[:, live]))
        (got, kv), (want, kv_want) = outs
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
        assert torch.equal(kv, kv_want), name
    assert seen[:2] == ["bf16", "fp32"]
