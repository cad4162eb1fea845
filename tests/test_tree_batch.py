"""Sampled trees of any shapes verified together on the device (:mod:`spec_core.tree_batch`): each round's tokens
and accepted nodes are those of the per-request rule (:func:`spec_core.tree.stochastic_verify_tree_path`), whatever
the batch, in one upload and one download. The distribution tests of the same kernel are in
tests/test_tree_verify.py."""

from __future__ import annotations

import pytest
import torch
from conftest import random_dists

from spec_core.transfer import crossings, to_host
from spec_core.tree import SampledRound, TokenTree, stochastic_verify_tree_path
from spec_core.tree_batch import tree_outcomes, tree_results

V = 6


def _round(gen: torch.Generator, n: int, sparse: bool) -> SampledRound:
    """A random tree of ``n`` nodes (siblings with duplicate tokens are likely at this vocabulary), each node drawn
    from its q row, target rows near their children's q so that some nodes pass; ``sparse``: rows with zeros."""
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
    q = random_dists(gen, n, V, sparse)
    toks = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(n)]
    p = random_dists(gen, n + 1, V, sparse)
    for c, par in enumerate(parents):  # a row leans towards its children's q, so that some of them pass
        p[par + 1] += q[c]
    p = p / p.sum(-1, keepdim=True)
    return SampledRound(p, TokenTree(parents, toks, q), torch.rand(n + 1, generator=gen))


def _verify(rounds: list[SampledRound], sibling_recursion: bool = True) -> list[tuple[list[int], list[int]]]:
    return tree_results(to_host(tree_outcomes(rounds, sibling_recursion)))


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("sibling_recursion", [True, False])
def test_mixed_shapes_equal_the_per_request_rule(sparse, sibling_recursion):
    gen = torch.Generator().manual_seed(3)
    rounds = [_round(gen, n, sparse) for _ in range(30) for n in (1, 3, 5, 8)]
    want = [stochastic_verify_tree_path(r.probs, r.tree, r.uniforms, sibling_recursion) for r in rounds]
    assert _verify(rounds, sibling_recursion) == want
    assert [_verify([r], sibling_recursion)[0] for r in rounds[:8]] == want[:8]  # alone or in a batch alike
    siblings = [r for r in rounds if len(set(r.tree.parents)) < r.tree.num_nodes]
    assert len(siblings) > 30 and {len(path) for _, path in want} >= {0, 1, 2}  # rejections at several depths


def test_the_check_sees_a_uniform_out_of_order():
    """Negative control: the same rounds with each request's uniforms reversed verify differently."""
    gen = torch.Generator().manual_seed(4)
    rounds = [_round(gen, 4, False) for _ in range(30)]
    flipped = [SampledRound(r.probs, r.tree, r.uniforms.flip(0)) for r in rounds]
    assert _verify(flipped) != [stochastic_verify_tree_path(r.probs, r.tree, r.uniforms) for r in rounds]


def test_one_upload_and_one_download_for_the_batch():
    gen = torch.Generator().manual_seed(5)
    rounds = [_round(gen, 2 + i % 5, False) for i in range(16)]
    before = (crossings().uploads, crossings().downloads)
    _verify(rounds)
    assert (crossings().uploads - before[0], crossings().downloads - before[1]) == (1, 1)


def test_a_tree_without_draft_rows_or_with_a_tail_is_refused():
    q = torch.full((2, V), 1 / V)
    p = torch.full((3, V), 1 / V)
    with pytest.raises(ValueError, match="draft rows"):
        tree_outcomes([SampledRound(p, TokenTree([-1, -1], [1, 2], None), torch.rand(3))])
    with pytest.raises(ValueError, match="tail"):
        tree_outcomes([SampledRound(p, TokenTree([-1, 0], [1, 2], q, tail=(3, q[0])), torch.rand(4))])
