"""Exact multi-branch speculative sampling of many trees at once, on the device, with no host synchronisation.

The rule is :func:`spec_core.tree.stochastic_verify_tree_path`'s (recursive rejection over siblings), vectorised
over the batch: each row walks its own child table, tests the children of its current node in order, consumes its
uniforms in the per-request order, and draws its last token from the current residual. So each row's tokens and
accepted nodes are those of the per-request rule, whatever the batch and whatever the other rows' shapes.

A step's sampled trees (:func:`tree_outcomes`) cross up in one float32 buffer (child tables, token ids and the
24-bit uniforms are exact in float32) and down in one copy of every row's (emitted tokens, accepted nodes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spec_core.rejection import PLACEHOLDER, RejectionOutput
from spec_core.sampling import sample_from_probs
from spec_core.transfer import to_device
from spec_core.tree import SampledRound, TokenTree, residual


def verify_padded(target_probs: torch.Tensor, table: torch.Tensor, token_ids: torch.Tensor,
                  draft_probs: torch.Tensor, uniforms: torch.Tensor, depth: int, sibling_recursion: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B trees of any shapes, padded to M nodes: ``target_probs [B, M+1, V]``, ``table [B, M+1, F]`` (row i + 1
    lists node i's children in order, row 0 the root's, padded with -1), ``token_ids [B, M]``, ``draft_probs
    [B, M, V]``, ``uniforms [B, M+1]``, ``depth`` at least the deepest tree's.

    Returns emitted tokens ``[B, depth+1]`` (padded with ``PLACEHOLDER``), accepted counts ``[B]`` and accepted
    nodes ``[B, depth]`` (padded with -1). ``sibling_recursion=False`` is a NEGATIVE CONTROL ONLY (biased): every
    sibling is tested against the original p, and after all are rejected the last token comes from
    norm(max(0, p - q_last))."""
    bsz, n1, _ = target_probs.shape
    dev = target_probs.device
    rows = torch.arange(bsz, device=dev)
    out = torch.full((bsz, depth + 1), PLACEHOLDER, dtype=torch.long, device=dev)
    path = torch.full((bsz, max(depth, 1)), -1, dtype=torch.long, device=dev)
    num_acc = torch.zeros(bsz, dtype=torch.long, device=dev)
    counter = torch.zeros(bsz, dtype=torch.long, device=dev)
    done = torch.zeros(bsz, dtype=torch.bool, device=dev)
    cur = torch.full((bsz,), -1, dtype=torch.long, device=dev)
    p = target_probs[:, 0]
    for step in range(depth + 1):
        p_orig, q_last = p, torch.zeros_like(p)
        moved, tested = torch.zeros_like(done), torch.zeros_like(done)
        nxt = cur.clone()
        slots = table[rows, cur + 1]
        for j in range(table.shape[-1]):
            c = slots[:, j]
            active = ~done & ~moved & (c >= 0)
            cc = c.clamp_min(0)
            x = token_ids[rows, cc] if n1 > 1 else cc
            q = draft_probs[rows, cc] if n1 > 1 else torch.zeros_like(p)
            acc = active & (uniforms[rows, counter] * q[rows, x] < p[rows, x])  # p stays p_orig without recursion
            counter = counter + active.long()
            moved |= acc
            nxt = torch.where(acc, c, nxt)
            rej = active & ~acc
            if sibling_recursion:
                p = torch.where(rej[:, None], residual(p, q), p)
            else:
                q_last = torch.where(rej[:, None], q, q_last)
                tested |= rej
        stop = ~done & ~moved
        dist = p if sibling_recursion else torch.where(tested[:, None], residual(p_orig, q_last), p_orig)
        last = sample_from_probs(dist, uniforms[rows, counter.clamp(max=n1 - 1)])
        taken = token_ids[rows, nxt.clamp_min(0)] if n1 > 1 else out[:, step]
        out[:, step] = torch.where(stop, last, torch.where(moved, taken, out[:, step]))
        if step < depth:
            path[:, step] = torch.where(moved, nxt, path[:, step])
        num_acc += moved.long()
        done |= stop
        cur = nxt
        p = torch.where(moved[:, None], target_probs[rows, cur + 1], p)
    return out, num_acc, path[:, :depth]


def stochastic_verify_tree_batch(
    target_probs: torch.Tensor,
    parents: Sequence[int],
    token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    sibling_recursion: bool = True,
) -> RejectionOutput:
    """:func:`~spec_core.tree.stochastic_verify_tree` for B trees of one shape: ``target_probs [B, N+1, V]``,
    ``parents`` (shared), ``token_ids [B, N]``, ``draft_probs [B, N, V]``, ``uniforms [B, N+1]``. Returns
    ``token_ids [B, D+1]`` (D = tree depth, padded with -1) and ``num_accepted [B]``."""
    kids, depth = _shape(parents)
    table = to_device([_padded(kids, max(1, max(map(len, kids))))], target_probs.device, torch.long)
    out, num_acc, _ = verify_padded(target_probs, table.expand(target_probs.shape[0], -1, -1), token_ids,
                                    draft_probs, uniforms, depth, sibling_recursion)
    return RejectionOutput(out, num_acc)


def tree_outcomes(rounds: list[SampledRound], sibling_recursion: bool = True) -> torch.Tensor:
    """Every round's emitted tokens and accepted nodes, ``[G, 2D+1]`` on the device (D: the deepest tree's depth;
    :func:`tree_results` reads them on the host). Trees with a ``tail`` go to :mod:`spec_core.chain_verify`.
    ``sibling_recursion=False``: the NEGATIVE CONTROL of :func:`verify_padded`."""
    for r in rounds:
        if r.tree.draft_probs is None or r.tree.tail is not None:
            raise ValueError("batched tree verification needs draft rows and no tail")
    shapes = [_shape(r.tree.parents) for r in rounds]
    m = max(r.tree.num_nodes for r in rounds)
    fan = max(1, max(len(k) for kids, _ in shapes for k in kids))
    depth = max(d for _, d in shapes)
    table, tokens, uniforms = _upload(rounds, [kids for kids, _ in shapes], m, fan)
    p, q = _rows(rounds, m)
    out, _, path = verify_padded(p, table, tokens, q, uniforms, depth, sibling_recursion)
    return torch.cat([out, path], 1)


def tree_results(outcomes: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """(emitted tokens, accepted node indices) of every round from its downloaded :func:`tree_outcomes` row."""
    results = []
    for row in outcomes:
        depth = (len(row) - 1) // 2
        results.append(([t for t in row[: depth + 1] if t != PLACEHOLDER], [i for i in row[depth + 1 :] if i >= 0]))
    return results


def _shape(parents: Sequence[int]) -> tuple[list[list[int]], int]:
    shape = TokenTree(list(parents), [0] * len(parents))
    return shape.child_lists(), max(shape.depths(), default=0)


def _padded(kids: list[list[int]], fan: int, rows: int | None = None) -> list[list[int]]:
    table = [k + [-1] * (fan - len(k)) for k in kids]
    return table + [[-1] * fan] * ((rows or len(table)) - len(table))


def _upload(rounds: list[SampledRound], kids: list[list[list[int]]], m: int, fan: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Child tables ``[G, M+1, F]``, token ids ``[G, M]`` and uniforms ``[G, M+1]`` on the device, in one copy."""
    g, span = len(rounds), (m + 1) * fan
    host = torch.zeros(g, span + 2 * m + 1, dtype=torch.float32)
    for i, (r, k) in enumerate(zip(rounds, kids)):
        n = r.tree.num_nodes
        host[i, :span] = torch.as_tensor(_padded(k, fan, m + 1), dtype=torch.float32).view(-1)
        host[i, span : span + n] = torch.as_tensor(r.tree.token_ids, dtype=torch.float32)
        host[i, span + m : span + m + n + 1] = r.uniforms[: n + 1]
    up = to_device(host, rounds[0].probs.device)
    return up[:, :span].long().view(g, m + 1, fan), up[:, span : span + m].long(), up[:, span + m :]


def _rows(rounds: list[SampledRound], m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target rows ``[G, M+1, V]`` and draft rows ``[G, M, V]``, padded with zero rows."""
    vocab = rounds[0].probs.shape[-1]
    p = rounds[0].probs.new_zeros(len(rounds), m + 1, vocab)
    q = rounds[0].probs.new_zeros(len(rounds), m, vocab)
    for i, r in enumerate(rounds):
        n = r.tree.num_nodes
        p[i, : n + 1] = r.probs
        q[i, :n] = r.tree.draft_probs
    return p, q
