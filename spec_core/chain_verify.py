"""Exact speculative sampling of a step's sampled chains at once, on the device: one upload, one download.

A chain's rule is :func:`spec_core.tree.stochastic_verify_tree_path`'s for a tree of one branch: node t (token
x_t, drawn from q_t) is accepted while ``u_t · q_t(x_t) < p_t(x_t)``; at the first rejection the round's last token
is drawn from norm(max(0, p_t − q_t)) (p_t where that is all zero) with the next uniform; with every node accepted
it is drawn from the row after the chain, or, where the chain has a ``tail``, the tail is tested as one more node
and, accepted, is the last token. The uniforms are consumed in that order, so each request's tokens are those of
the per-request rule, whatever the batch.

Everything but the requests' tokens and uniforms stays on the device: they cross up in one float32 buffer (token
ids and the 24-bit uniforms are exact in float32), and each request's (tests passed, last token) crosses down in
one copy for the whole batch.
"""

from __future__ import annotations

import torch

from spec_core.sampling import sample_from_probs
from spec_core.transfer import to_device, to_host
from spec_core.tree import SampledRound, TokenTree, residual


def is_chain(tree: TokenTree) -> bool:
    """Whether ``tree`` is one branch (every node the child of the one before) with draft rows."""
    return tree.draft_probs is not None and all(par == i - 1 for i, par in enumerate(tree.parents))


def verify_chains(rounds: list[SampledRound]) -> list[tuple[list[int], list[int]]]:
    """(emitted tokens, accepted node indices) of every round, as :func:`stochastic_verify_tree_path` gives them."""
    if not rounds:
        return []
    return chain_results(rounds, to_host(chain_outcomes(rounds)))


def chain_results(rounds: list[SampledRound], outcomes: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """(emitted tokens, accepted node indices) of every round from its downloaded (tests passed, last token)."""
    return [_emitted(r.tree, t, d) for r, (t, d) in zip(rounds, outcomes)]


def chain_outcomes(rounds: list[SampledRound]) -> torch.Tensor:
    """Every round's (tests passed, last token) ``[G, 2]``, on the device (nothing downloaded)."""
    g = len(rounds)
    tokens, uniforms, tests = _upload(rounds)
    width = uniforms.shape[1]
    p, q = _rows(rounds, width)
    steps = torch.arange(width - 1, device=p.device)[None]
    p_x = p[:, :-1].gather(-1, tokens[..., None])[..., 0]
    q_x = q.gather(-1, tokens[..., None])[..., 0]
    failed = (uniforms[:, :-1] * q_x >= p_x) & (steps < tests[:, None])
    passed = torch.where(failed.any(-1), failed.float().argmax(-1), tests)
    rejected = passed < tests
    rows = torch.arange(g, device=p.device)
    target = p[rows, passed]
    final = torch.where(rejected[:, None], residual(target, q[rows, passed.clamp(max=width - 2)]), target)
    drawn = sample_from_probs(final, uniforms[rows, passed + rejected.long()])
    return torch.stack([passed, drawn], 1)


def _upload(rounds: list[SampledRound]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids ``[G, W-1]``, uniforms ``[G, W]`` and test counts ``[G]`` on the device, in one copy (W: the most
    tests plus one)."""
    g = len(rounds)
    tests = [r.tree.num_nodes + (r.tree.tail is not None) for r in rounds]
    width = max(tests) + 1
    host = torch.zeros(2 * g, width, dtype=torch.float32)
    for i, (r, t) in enumerate(zip(rounds, tests)):
        host[i, :t] = torch.as_tensor(_tokens(r.tree), dtype=torch.float32)
        host[i, -1] = t
        host[g + i, : t + 1] = r.uniforms[: t + 1]
    up = to_device(host, rounds[0].probs.device)
    return up[:g, :-1].long(), up[g:], up[:g, -1].long()


def _tokens(tree: TokenTree) -> list[int]:
    return list(tree.token_ids) + ([tree.tail[0]] if tree.tail is not None else [])


def _rows(rounds: list[SampledRound], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target rows ``[G, width, V]`` and draft rows ``[G, width - 1, V]`` (a tail's q after its chain's), padded
    with zero rows."""
    vocab = rounds[0].probs.shape[-1]
    p = rounds[0].probs.new_zeros(len(rounds), width, vocab)
    q = rounds[0].probs.new_zeros(len(rounds), width - 1, vocab)
    for i, r in enumerate(rounds):
        n = r.tree.num_nodes
        p[i, : n + 1] = r.probs
        if n:
            q[i, :n] = r.tree.draft_probs
        if r.tree.tail is not None:
            p[i, n + 1] = r.probs[n]  # a placeholder: nothing is drawn after an accepted tail
            q[i, n] = r.tree.tail[1]
    return p, q


def _emitted(tree: TokenTree, passed: int, drawn: int) -> tuple[list[int], list[int]]:
    n = tree.num_nodes
    nodes = min(passed, n)
    if tree.tail is not None and passed == n + 1:  # the tail accepted: it is the round's last token
        return list(tree.token_ids) + [tree.tail[0]], list(range(n))
    return list(tree.token_ids[:nodes]) + [drawn], list(range(nodes))
