"""The static-buffer step (:mod:`spec_core.backends.static_step`), fp32 on a CPU: every real token's logits and K/V
are the dynamic ``forward_paged``'s, bit for bit, for batches of several requests, a tree batch and context lengths
not seen before.

Padding rows and tokens is exact. Padding the attended slots is not, in general: torch's CPU attention reduces over
the key axis in groups that depend on the key count (the P·V product and the flash kernel's exp-sum), so 21 keys and
21 keys plus 3 masked ones can round differently (a few 1e-6 on the logits). The dynamic step pads a short row's
slots the same way beside a longer row, so a step whose bucket has more slots equals, bit for bit, the dynamic
forward of the same batch widened to the bucket's slots (:func:`widen`); with ``context_step=1`` the bucket's slots
are the batch's own and the step equals the plain dynamic forward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from work_items import work_item

from spec_core.backends.static_step import Buckets, StaticStep, batch_buckets, power_buckets
from spec_core.kv_cache import PagedBatch
from spec_core.packing import pack
from spec_core.runner import ModelRunner


@pytest.fixture(scope="module")
def runner(toy_pair):
    r = ModelRunner(toy_pair["target"])
    assert r.exact and r.kernels is None  # the fp32 torch path: the exactness reference
    return r


def require_row_invariant_gemm(runner, *pairs: tuple[int, int]) -> None:
    """Skip (naming the row counts) where this CPU's fp32 GEMM rounds the first ``n`` of ``m`` rows differently from
    ``n`` rows alone: the static step pads rows, so there it cannot equal the unpadded step bit for bit. (A BLAS
    picks its kernels by row count: one measured CPU switches between 3 and 4 rows; 5 to 8 and 24 to 32 were
    exact on every CPU tried.)"""
    gen = torch.Generator().manual_seed(0)
    shapes = {tuple(w.shape) for w in runner.weight_matrices() if isinstance(w, torch.Tensor) and w.dim() == 2}
    for n, m in pairs:
        for in_f, out_f in sorted(shapes):  # the runner's fp32 layout: ``x @ w``, w ``[in, out]``
            w = torch.randn(in_f, out_f, generator=gen)
            x = torch.randn(m, in_f, generator=gen)
            if not torch.equal(x[:n] @ w, (x @ w)[:n]):
                pytest.skip(f"this CPU's fp32 GEMM rounds {n} rows differently from the first {n} of {m} "
                            f"({in_f}x{out_f}): padded rows cannot be exact here")


def widen(batch: PagedBatch, slots: int, scratch: int) -> PagedBatch:
    """``batch`` attending ``slots`` slot columns: the extra ones read the scratch slot and are masked off for every
    query (what :func:`pack` gives a row shorter than the batch's longest)."""
    bsz, t = batch.input_ids.shape
    s = batch.kv_slots.shape[1]
    kv = torch.full((bsz, slots), scratch, dtype=torch.long)
    kv[:, :s] = batch.kv_slots
    mask = torch.zeros(bsz, t, slots, dtype=torch.bool)
    mask[:, :, :s] = True if batch.attn_mask is None else batch.attn_mask
    return dataclasses.replace(batch, kv_slots=kv, attn_mask=mask)


def _run(runner, steps, step=None, widened=None):
    """Logits of each step's batch and the live K/V after the last: the dynamic forward, the static ``step`` (built
    on this cache by ``step(cache)``), or the dynamic forward of each batch widened to ``widened(batch)`` slots."""
    cache = runner.new_paged_cache(64, 16)
    static = step(cache) if step else None
    outs = []
    for items in steps:
        batch = pack(items, cache.scratch_slot)
        if static is not None:
            outs.append(static(cache, batch).clone())
        elif widened is not None:
            outs.append(runner.forward_paged(cache, widen(batch, widened(batch), cache.scratch_slot)))
        else:
            outs.append(runner.forward_paged(cache, batch))
    live = [s for s in range(cache.kv.shape[1]) if s != cache.scratch_slot]
    return outs, cache.kv[:, live].clone(), static


def _static(runner, **buckets):
    return lambda cache: StaticStep(runner.forward_paged, cache.scratch_slot, runner.device,
                                    Buckets(max_tokens=32, **buckets))


def _assert_equal(got, want):
    (logits, kv, _), (ref, kv_ref, _) = got, want
    assert len(logits) == len(ref)
    for i, (a, b) in enumerate(zip(logits, ref)):
        assert a.shape == b.shape and torch.equal(a, b), f"step {i}: max |diff| {(a - b).abs().max():.3g}"
    assert torch.equal(kv, kv_ref), f"K/V: max |diff| {(kv - kv_ref).abs().max():.3g}"


IDS = torch.randint(0, 8000, (400,), generator=torch.Generator().manual_seed(5)).tolist()
PREFILL = [work_item(IDS, 0, 20, 0), work_item(IDS, 0, 24, 256), work_item(IDS, 0, 7, 512)]


def test_buckets():
    assert batch_buckets(1) == (1,) and batch_buckets(3) == (1, 2, 3)
    assert batch_buckets(64) == (1, 2, 3, 4, 8, 16, 32, 48, 64) and batch_buckets(70)[-1] == 80
    assert power_buckets(5) == (1, 2, 3, 4, 8) and power_buckets(1) == (1,) and power_buckets(16)[-1] == 16
    b = Buckets(max_batch=8, max_tokens=8, max_context=300, context_step=64)
    assert [b.context(s) for s in (1, 64, 65, 290)] == [64, 64, 128, 300]
    batch = pack([work_item(IDS, 20, 5, 0)] * 3, 999)
    assert b.key(batch) == (3, 8, 64, 8) and b.fits(batch)
    assert not b.fits(pack([work_item(IDS, 0, 9, 0)], 999)) and not b.fits(pack([work_item(IDS, 0, 1, 0)] * 9, 999))


def test_several_requests_equal_the_dynamic_step(runner):
    """A prefill of five requests (5 rows padded to 8, 24 tokens to 32), then ragged decode and verify rows (5
    tokens padded to 8) and plain decode rows (no mask in the dynamic batch; the static one always has one)."""
    require_row_invariant_gemm(runner, (120, 256), (25, 64), (5, 8))
    more = PREFILL + [work_item(IDS, 0, 9, 768), work_item(IDS, 0, 11, 1000)]
    steps = [more,
             [work_item(IDS, 20, 1, 0), work_item(IDS, 24, 5, 256), work_item(IDS, 7, 3, 512),
              work_item(IDS, 9, 2, 768), work_item(IDS, 11, 1, 1000)],
             [work_item(IDS, 21, 1, 0), work_item(IDS, 29, 1, 256), work_item(IDS, 10, 1, 512),
              work_item(IDS, 11, 1, 768), work_item(IDS, 12, 1, 1000)]]
    got = _run(runner, steps, _static(runner, context_step=1))
    _assert_equal(got, _run(runner, steps))
    assert {k[:2] for k in got[2].buffers} == {(8, 32), (8, 8), (8, 1)}


def test_a_tree_batch_equals_the_dynamic_step(runner):
    """A tree row (custom mask: nodes see their ancestors) beside a chain and a decode row."""
    require_row_invariant_gemm(runner, (72, 96), (18, 24))
    steps = [PREFILL,
             [work_item(IDS, 20, 6, 0, parents=(-1, -1, 0, 0, 1)), work_item(IDS, 24, 4, 256),
              work_item(IDS, 7, 1, 512)]]
    _assert_equal(_run(runner, steps, _static(runner, context_step=1)), _run(runner, steps))


def test_new_context_lengths(runner):
    """Decode at lengths not seen before: exact against the dynamic step with the batch's own slot count, and with
    64-slot buckets every length reuses its bucket's buffers and equals the dynamic step widened to them."""
    require_row_invariant_gemm(runner, (48, 64))
    steps = [PREFILL[:2]] + [[work_item(IDS, 20 + i, 1, 0), work_item(IDS, 24 + i, 1, 256)] for i in range(0, 48, 7)]
    _assert_equal(_run(runner, steps, _static(runner, context_step=1)), _run(runner, steps))
    bucketed = _run(runner, steps, _static(runner, context_step=64))
    assert {k[2] for k in bucketed[2].buffers} == {64, 128}
    _assert_equal(bucketed, _run(runner, steps, widened=lambda b: -(-b.kv_slots.shape[1] // 64) * 64))


def test_beyond_the_buckets_runs_the_dynamic_step(runner):
    steps = [[work_item(IDS, 0, 40, 0)], [work_item(IDS, 40, 1, 0)]]
    got = _run(runner, steps, _static(runner, context_step=1))
    _assert_equal(got, _run(runner, steps))
    assert [k[1] for k in got[2].buffers] == [1]  # the 40-token prefill took the dynamic forward


def test_the_cpu_kernels_batch_invariant_runner_through_the_static_step(toy_pair):
    """int4 through the compiled kernels (batch invariant): the static step changes no bit, even with slot columns
    padded (their attention sums in slot order and skips masked keys)."""
    from spec_core.backends.cpu import cpu_kernels

    if cpu_kernels.quant_gemm() is None:
        pytest.skip("the CPU kernels cannot be built here")
    runner = ModelRunner(toy_pair["target"], weights="int4")
    assert runner.batch_invariant
    steps = [PREFILL, [work_item(IDS, 20, 1, 0), work_item(IDS, 24, 5, 256, parents=(-1, 0, 0)),
                       work_item(IDS, 7, 1, 512)]]
    _assert_equal(_run(runner, steps, _static(runner, context_step=64)), _run(runner, steps))
