"""Row-wise argmax and top-k (:mod:`spec_core.select`) return what torch's do, on every shape they take."""

from __future__ import annotations

import torch

from spec_core.select import BLOCK, argmax_rows, topk_rows


def test_argmax_rows_is_torchs_argmax_first_maximum_included() -> None:
    g = torch.Generator().manual_seed(0)
    for shape in ((1, 49152), (3, 1000), (2, 4, 640), (5, 7)):
        x = torch.randn(*shape, generator=g)
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    ties = torch.zeros(3, 640)
    ties[0, [9, 3, 600]] = 2.0  # the first of equal maxima, as torch documents
    ties[2, -1] = float("-inf")
    assert torch.equal(argmax_rows(ties), ties.argmax(-1)) and argmax_rows(ties).tolist() == [3, 0, 0]
    assert torch.equal(argmax_rows(x.to(torch.bfloat16)), x.to(torch.bfloat16).argmax(-1))  # torch's own


def test_topk_rows_finds_the_k_largest_wherever_they_sit() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 48 * BLOCK, generator=g)
    x[1, :BLOCK] = torch.arange(BLOCK) + 100.0  # every top value in one block
    x[2, -3:] = 50.0  # in the last block
    x[3] = float("-inf")
    x[3, [5, 700, 3000]] = torch.tensor([1.0, 3.0, 2.0])  # fewer finite values than k
    x[4, ::BLOCK] = 9.0  # one top value in each of many blocks
    for k in (1, 2, 3, 17, 47):
        vals, idx = topk_rows(x, k)
        ref = torch.topk(x, k, dim=-1)
        assert torch.equal(vals, ref.values)
        assert torch.equal(x.gather(1, idx), vals)  # the indices hold those values
        assert all(len(set(row.tolist())) == k for row in idx)  # distinct
    for shape, k in (((2, 1000), 5), ((2, 4 * BLOCK), 4)):  # not whole blocks, or k as large as the blocks: torch
        y = torch.randn(*shape, generator=g)
        assert torch.equal(topk_rows(y, k)[1], torch.topk(y, k, dim=-1).indices)
