"""Tree verification: TokenTree structure, handcrafted greedy cases, chain agreement with spec_core.rejection, the
batched implementation against the loop one, and chi-square tests that the joint of the first two emitted tokens is
the target's. Each statistical pass case has a negative control (same seed, same size) that must fail the test.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from spec_core.rejection import PLACEHOLDER, greedy_verify, stochastic_verify
from spec_core.sampling import normalise, sample_from_probs
from spec_core.tree import (
    TokenTree,
    greedy_verify_tree,
    stochastic_verify_tree,
    verify_trees,
)
from spec_core.tree_batch import stochastic_verify_tree_batch

VOCAB = 8
FANOUT = 3
N_LOOP = 50_000
N_BATCH = 200_000
PASS_P = 1e-3
FAIL_P = 1e-6
# Root fan-out of 3 siblings, each with one child: nodes [r0, c0, r1, c1, r2, c2].
PARENTS = [-1, 0, -1, 2, -1, 4]


def onehot_rows(ids: list[int], vocab: int = 10) -> torch.Tensor:
    out = torch.zeros(len(ids), vocab)
    out[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return out


# ----------------------------------------------------------------------------------------------- structure


def test_tree_validation_errors():
    with pytest.raises(ValueError, match="token_ids"):
        TokenTree([-1, 0], [1])
    with pytest.raises(ValueError, match="parent"):
        TokenTree([-1, 1], [1, 2])  # own index
    with pytest.raises(ValueError, match="parent"):
        TokenTree([-1, 2, 0], [1, 2, 3])  # forward reference
    with pytest.raises(ValueError, match="parent"):
        TokenTree([-2], [1])
    with pytest.raises(ValueError, match="draft_probs"):
        TokenTree([-1, 0], [1, 2], torch.rand(3, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        stochastic_verify_tree(torch.rand(2, 5), TokenTree([-1], [1]), torch.rand(2))


def test_structure_helpers_and_ancestor_mask():
    tree = TokenTree([-1, -1, 0, 0, 1, 2], [5, 7, 3, 4, 3, 9])
    assert tree.num_nodes == 6
    assert tree.depths() == [1, 1, 2, 2, 2, 3]
    assert tree.children(-1) == [0, 1] and tree.children(0) == [2, 3] and tree.children(5) == []
    assert tree.path_to(5) == [0, 2, 5] and tree.path_to(4) == [1, 4]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)
    assert TokenTree([], []).ancestor_mask().shape == (0, 0)


def test_chain_builder():
    q = torch.rand(4, 6)
    tree = TokenTree.chain([3, 1, 4, 1], q)
    assert tree.parents == [-1, 0, 1, 2] and tree.token_ids == [3, 1, 4, 1] and tree.draft_probs is q
    assert torch.equal(tree.ancestor_mask(), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert TokenTree.chain([]).parents == []


# ----------------------------------------------------------------------------------------------- greedy

HANDMADE = TokenTree([-1, -1, 0, 0, 1, 2], [5, 7, 3, 4, 3, 9])  # rows: 0 root, 1+i children of node i


@pytest.mark.parametrize(("argmax", "expected"), [
    ([5, 3, 0, 9, 0, 0, 1], [5, 3, 9, 1]),  # deepest match, then the bonus
    ([5, 4, 0, 0, 2, 0, 0], [5, 4, 2]),  # second sibling at depth 2, a leaf: bonus from its row
    ([7, 0, 3, 0, 0, 6, 0], [7, 3, 6]),  # switch to the second root branch
    ([5, 8, 0, 0, 0, 0, 0], [5, 8]),  # no depth-2 match: recovered token
    ([8, 3, 0, 9, 0, 0, 1], [8]),  # no match at all: just the target token
])
def test_greedy_handmade(argmax, expected):
    assert greedy_verify_tree(onehot_rows(argmax), HANDMADE) == expected


def test_greedy_duplicate_siblings_take_first_and_empty_tree():
    tree = TokenTree([-1, -1, 1], [2, 2, 6])
    assert greedy_verify_tree(onehot_rows([2, 6, 6, 4]), tree) == [2, 6]
    assert greedy_verify_tree(onehot_rows([4]), TokenTree([], [])) == [4]


@pytest.mark.parametrize("onehot", [True, False])
def test_greedy_chain_equals_rejection_greedy(onehot):
    gen = torch.Generator().manual_seed(1)
    bsz, k, vocab = 200, 5, 6
    logits = torch.randn(bsz, k + 1, vocab, generator=gen)
    if onehot:
        logits = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 5.0)
    drafts = logits[:, :k].argmax(-1)
    corrupt = torch.rand(bsz, k, generator=gen) < 0.25
    drafts = torch.where(corrupt, torch.randint(0, vocab, (bsz, k), generator=gen), drafts)
    num_draft = torch.randint(0, k + 1, (bsz,), generator=gen)
    ref = greedy_verify(logits, drafts, num_draft).parse()
    for b in range(bsz):
        n = int(num_draft[b])
        assert greedy_verify_tree(logits[b, : n + 1], TokenTree.chain(drafts[b, :n].tolist())) == ref[b]


def test_verify_trees_dispatch():
    tree = TokenTree.chain([1], torch.tensor([[0.0, 1.0, 0.0]]))
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    out = verify_trees([p, p], [tree, tree], [True, False], [None, torch.tensor([0.5, 0.5])])
    assert out == [[1, 2], [1, 2]]


# ----------------------------------------------------------------------------------------------- stochastic


def test_chain_replays_rejection_stochastic_verify():
    """Fed the uniforms stochastic_verify used (its accept tests, then its resample draw), the chain case is exact."""
    gen = torch.Generator().manual_seed(2)
    bsz, k, vocab = 300, 4, 6
    p = torch.softmax(2 * torch.randn(bsz, k + 1, vocab, generator=gen), -1)
    q = torch.softmax(2 * torch.randn(bsz, k, vocab, generator=gen), -1)
    drafts = sample_from_probs(q.reshape(-1, vocab), torch.rand(bsz * k, generator=gen)).view(bsz, k)
    num_draft = torch.randint(0, k + 1, (bsz,), generator=gen)
    acc_u, res_u = torch.rand(bsz, k, generator=gen), torch.rand(bsz, generator=gen)
    ref = stochastic_verify(p, q, drafts, num_draft, acc_u, res_u)
    for b, row in enumerate(ref.parse()):
        n, acc = int(num_draft[b]), int(ref.num_accepted[b])
        tests = acc + int(acc < n)
        uni = torch.cat([acc_u[b, :tests], res_u[b : b + 1], torch.zeros(n + 1)])
        assert stochastic_verify_tree(p[b, : n + 1], TokenTree.chain(drafts[b, :n].tolist(), q[b, :n]), uni) == row


@pytest.mark.parametrize("sibling_recursion", [True, False])
def test_batch_matches_loop(sibling_recursion):
    """Random shapes, small vocab (duplicate siblings, zeros, p == q rows): batched == loop, token for token."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        n, vocab, bsz = int(torch.randint(0, 8, (1,), generator=gen)), 4, 24
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
        target = normalise(torch.rand(bsz, n + 1, vocab, generator=gen) ** 3)
        q = normalise(torch.rand(bsz, n, vocab, generator=gen) ** 3 * (torch.rand(bsz, n, vocab, generator=gen) > 0.3))
        q = torch.where(q.sum(-1, keepdim=True) > 0, q, torch.full_like(q, 1 / vocab))
        if n:
            q[::4, 0] = target[::4, 0]  # p == q at the first root child: the residual falls back to p
        tokens = sample_from_probs(q.reshape(-1, vocab), torch.rand(bsz * n, generator=gen)).view(bsz, n)
        uni = torch.rand(bsz, n + 1, generator=gen)
        out = stochastic_verify_tree_batch(target, parents, tokens, q, uni, sibling_recursion).parse()
        for b in range(bsz):
            tree = TokenTree(parents, tokens[b].tolist(), q[b])
            assert stochastic_verify_tree(target[b], tree, uni[b], sibling_recursion) == out[b]


def _joint_chi2_pvalue(first: torch.Tensor, second: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit on the joint (first, second) over ``probs [V, V]``, merging cells with expected
    count < 5 into one (as in tests/test_rejection.py)."""
    vocab = probs.shape[0]
    counts = torch.bincount(first * vocab + second, minlength=vocab * vocab).double()
    expected = probs.reshape(-1).double() * first.numel()
    big = expected >= 5
    obs, exp = counts[big].tolist(), expected[big].tolist()
    if (~big).any():
        obs.append(counts[~big].sum().item())
        exp.append(expected[~big].sum().item())
    if any(o > 0 for o, e in zip(obs, exp, strict=True) if e == 0):
        return 0.0
    pairs = [(o, e) for o, e in zip(obs, exp, strict=True) if e > 0]
    obs, exp = [o for o, _ in pairs], [e for _, e in pairs]
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def _case(name: str) -> dict[str, torch.Tensor]:
    """Context-free target (p_root, p2[first token], p3 for depth 3) and drafts (q_root per sibling, q2 table)."""
    gen = torch.Generator().manual_seed(11)
    p_root, q_root = normalise(torch.rand(VOCAB, generator=gen) ** 2), normalise(torch.rand(VOCAB, generator=gen) ** 2)
    p2, q2 = normalise(torch.rand(VOCAB, VOCAB, generator=gen) ** 2), normalise(torch.rand(VOCAB, VOCAB, generator=gen) ** 2)
    q_sib = q_root.expand(FANOUT, -1).clone()  # siblings i.i.d. from q_root (with replacement)
    if name == "q_with_zeros":
        q_sib[:, :3] = 0
        q2[:, 5:] = 0
        q_sib, q2 = normalise(q_sib), normalise(q2)
    elif name == "distinct_sibling_q":  # sibling k drawn independently from its own q_k
        q_sib = normalise(torch.rand(FANOUT, VOCAB, generator=gen) ** 2)
    return {"p_root": p_root, "p2": p2, "p3": p_root, "q_sib": q_sib, "q2": q2}


def _sample_trees(c: dict[str, torch.Tensor], n: int, gen: torch.Generator):
    """Vectorised drafting of ``n`` trees: returns target [n, 7, V], token_ids [n, 6], draft_probs [n, 6, V]."""
    roots = torch.stack([sample_from_probs(c["q_sib"][k].expand(n, -1), torch.rand(n, generator=gen))
                         for k in range(FANOUT)], 1)
    kids = sample_from_probs(c["q2"][roots.reshape(-1)], torch.rand(n * FANOUT, generator=gen)).view(n, FANOUT)
    tokens = torch.stack([roots, kids], 2).reshape(n, 2 * FANOUT)
    q_rows = torch.stack([c["q_sib"].expand(n, -1, -1), c["q2"][roots]], 2).reshape(n, 2 * FANOUT, VOCAB)
    p_rows = torch.stack([c["p2"][roots], c["p3"].expand(n, FANOUT, -1)], 2).reshape(n, 2 * FANOUT, VOCAB)
    target = torch.cat([c["p_root"].expand(n, 1, -1), p_rows], 1)
    return target, tokens, q_rows


def _first_two(first: torch.Tensor, second: torch.Tensor, c: dict[str, torch.Tensor], gen: torch.Generator):
    """Rounds that emitted one token (every root child rejected) stop there; the next round of a real system would
    draw the second token from p2[first], so emulate it with fresh randomness."""
    fresh = sample_from_probs(c["p2"][first], torch.rand(first.numel(), generator=gen))
    return first, torch.where(second >= 0, second, fresh)


def _run_loop(name: str, sibling_recursion: bool) -> float:
    c, gen = _case(name), torch.Generator().manual_seed(5)
    target, tokens, q_rows = _sample_trees(c, N_LOOP, gen)
    uni = torch.rand(N_LOOP, len(PARENTS) + 1, generator=gen)
    tok_lists = tokens.tolist()
    first, second = torch.empty(N_LOOP, dtype=torch.long), torch.full((N_LOOP,), -1, dtype=torch.long)
    for b in range(N_LOOP):
        out = stochastic_verify_tree(target[b], TokenTree(PARENTS, tok_lists[b], q_rows[b]), uni[b], sibling_recursion)
        first[b] = out[0]
        if len(out) > 1:
            second[b] = out[1]
    return _joint_chi2_pvalue(*_first_two(first, second, c, gen), c["p_root"][:, None] * c["p2"])


def _run_batch(name: str, sibling_recursion: bool) -> float:
    c, gen = _case(name), torch.Generator().manual_seed(5)
    target, tokens, q_rows = _sample_trees(c, N_BATCH, gen)
    uni = torch.rand(N_BATCH, len(PARENTS) + 1, generator=gen)
    out = stochastic_verify_tree_batch(target, PARENTS, tokens, q_rows, uni, sibling_recursion).token_ids
    return _joint_chi2_pvalue(*_first_two(out[:, 0], out[:, 1], c, gen), c["p_root"][:, None] * c["p2"])


def test_loop_tree_matches_target_joint():
    assert _run_loop("random", True) > PASS_P


def test_loop_negative_control_fails():
    """No sibling recursion: later siblings tested against the original p, so min(p, q) is over-weighted."""
    assert _run_loop("random", False) < FAIL_P


@pytest.mark.parametrize("case", ["random", "q_with_zeros", "distinct_sibling_q"])
def test_batch_tree_matches_target_joint(case):
    assert _run_batch(case, True) > PASS_P


@pytest.mark.parametrize("case", ["random", "q_with_zeros", "distinct_sibling_q"])
def test_batch_negative_control_fails(case):
    assert _run_batch(case, False) < FAIL_P


def test_tree_distribution_on_small_model(tmp_path):
    """First two tokens of stochastic tree verification follow a real (tiny, vocab 32) target model's joint
    distribution; p and q come from two random Llama models, 50k samples in one batched run."""
    from conftest import save_tiny_model

    from spec_core.runner import ModelRunner
    from spec_core.sampling import logits_to_probs

    vocab = 32
    target = ModelRunner(save_tiny_model(tmp_path / "t", "llama", 21, vocab_size=vocab))
    draft = ModelRunner(save_tiny_model(tmp_path / "d", "llama", 22, vocab_size=vocab, num_hidden_layers=1))
    prompt = [3, 1, 4, 1, 5]

    def dists(runner):
        ctx = torch.tensor([prompt + [a] for a in range(vocab)])
        logits = runner.forward(runner.new_cache(vocab, 8), ctx, torch.arange(len(prompt) + 1).expand(vocab, -1))
        temp = torch.full((vocab,), 0.8)
        root = logits_to_probs(logits[:1, -2], temp[:1])[0]
        return root, logits_to_probs(logits[:, -1], temp)  # p(.|prompt), p(.|prompt + a)

    p_root, p2 = dists(target)
    q_root, q2 = dists(draft)
    n, fan = 50_000, 3
    gen = torch.Generator().manual_seed(9)
    roots = torch.multinomial(q_root, n * fan, replacement=True, generator=gen).view(n, fan)
    kids = torch.multinomial(q2[roots.view(-1)], 1, generator=gen).view(n, fan)
    token_ids = torch.cat([roots, kids], 1)
    parents = [-1] * fan + list(range(fan))
    draft_probs = torch.cat([q_root.expand(n, fan, vocab), q2[roots]], 1)
    # Rows: root, then children of each node. Rows of the depth-2 nodes only feed a third token (not tested here).
    target_probs = torch.cat([p_root.expand(n, 1, vocab), p2[roots], p2[kids]], 1)

    def first_two(recursion: bool) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(5)
        out = stochastic_verify_tree_batch(target_probs, parents, token_ids, draft_probs,
                                           torch.rand(n, 2 * fan + 1, generator=g), sibling_recursion=recursion)
        first, second = out.token_ids[:, 0], out.token_ids[:, 1]
        # A round that emitted one token continues next round from p(.|prompt + first): draw that here.
        fresh = torch.multinomial(p2[first], 1, generator=g).squeeze(1)
        second = torch.where(second == PLACEHOLDER, fresh, second)
        return first, second

    joint = p_root[:, None] * p2
    assert _joint_chi2_pvalue(*first_two(True), joint) > PASS_P
    assert _joint_chi2_pvalue(*first_two(False), joint) < FAIL_P
