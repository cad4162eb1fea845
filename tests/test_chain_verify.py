"""Sampled chains verified together on the device (:mod:`spec_core.chain_verify`): each round's tokens are those of
the per-request rule (:func:`spec_core.tree.stochastic_verify_tree_path`), with and without a tail, whatever the
batch, in one upload and one download."""

from __future__ import annotations

import pytest
import torch
from conftest import random_dists

from spec_core.chain_verify import is_chain, verify_chains
from spec_core.transfer import crossings
from spec_core.tree import SampledRound, TokenTree, stochastic_verify_tree_path

V = 12


def _round(gen: torch.Generator, n: int, tail: bool, sparse: bool) -> SampledRound:
    """A chain of ``n`` nodes drawn from its q rows, target rows ``p`` near q (so some nodes pass), random
    uniforms; ``sparse``: rows with zeros, so residuals and draws meet zero-mass tokens."""
    q = random_dists(gen, n + 1, V, sparse)
    p = 0.5 * q[: n + 1] + 0.5 * random_dists(gen, n + 1, V, sparse)
    toks = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(n + 1)]
    tree = TokenTree(list(range(-1, n - 1)), toks[:n], q[:n], tail=(toks[n], q[n]) if tail else None)
    return SampledRound(p, tree, torch.rand(n + 2, generator=gen))


@pytest.mark.parametrize("sparse", [False, True])
def test_batched_chains_equal_the_per_request_rule(sparse):
    gen = torch.Generator().manual_seed(3)
    rounds = [_round(gen, n, tail, sparse) for _ in range(40) for n in (1, 2, 4) for tail in (False, True)]
    want = [stochastic_verify_tree_path(r.probs, r.tree, r.uniforms) for r in rounds]
    assert verify_chains(rounds) == want
    assert [verify_chains([r])[0] for r in rounds[:12]] == want[:12]  # alone or in a batch alike
    lengths = {len(path) for _, path in want}
    assert lengths >= {0, 1, 2} and any(r.tree.tail and len(e) == r.tree.num_nodes + 1 for r, (e, _) in
                                        zip(rounds, want))  # rejections at several depths, and accepted tails


def test_the_check_sees_a_uniform_out_of_order():
    """Negative control: the same rounds with each request's uniforms reversed verify differently."""
    gen = torch.Generator().manual_seed(4)
    rounds = [_round(gen, 3, False, False) for _ in range(30)]
    flipped = [SampledRound(r.probs, r.tree, r.uniforms.flip(0)) for r in rounds]
    assert verify_chains(flipped) != [stochastic_verify_tree_path(r.probs, r.tree, r.uniforms) for r in rounds]


def test_one_upload_and_one_download_for_the_batch():
    gen = torch.Generator().manual_seed(5)
    rounds = [_round(gen, 3, i % 2 == 0, False) for i in range(16)]
    before = (crossings().uploads, crossings().downloads)
    verify_chains(rounds)
    assert (crossings().uploads - before[0], crossings().downloads - before[1]) == (1, 1)


def test_only_chains_with_draft_rows_qualify():
    q = torch.full((2, V), 1 / V)
    assert is_chain(TokenTree([-1, 0], [1, 2], q))
    assert not is_chain(TokenTree([-1, -1], [1, 2], q))  # two siblings
    assert not is_chain(TokenTree([-1, 0], [1, 2], None))  # greedy: no draft rows
