"""Token-tree verification (SpecInfer-style): greedy and exact multi-branch stochastic sampling.

A tree holds N draft nodes in topological order; ``parents[i] == -1`` hangs node i off the root (the last committed
token). The verifier runs one target forward over ``[last_committed] + nodes`` with :meth:`TokenTree.ancestor_mask`
as the attention mask among new nodes, giving ``target [N+1, V]``: row 0 is the distribution after the committed
prefix, row ``1 + i`` the distribution for the children of node i. A round emits the accepted path followed by one
recovered (after rejecting every child) or bonus (at a leaf) token.

Stochastic rule (Miao et al. 2024, recursive rejection over siblings): at a node with target p, test its children
c_1..c_m in order; accept c_k with probability min(1, p(x_k)/q_k(x_k)); on rejection set p := norm(max(0, p - q_k))
and try the next sibling; if all are rejected (or there are none) draw the last token from the current p. Why it is
exact: one test of x ~ q against p emits x with probability min(p, q)(x), and otherwise passes on the residual, so
"accept, or continue with the residual" is distributed as p, by induction over the remaining siblings. This needs
sibling k to be drawn from q_k independently of the earlier siblings: i.i.d. sampling *with replacement* (duplicate
tokens allowed) from the same q satisfies it; sampling without replacement would need a different q update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spec_core.sampling import normalise, sample_from_probs
from spec_core.transfer import to_host


@dataclass(frozen=True, slots=True)
class TokenTree:
    """Draft tree: ``parents[i]`` (-1 = root), ``token_ids[i]``, and ``draft_probs [N, V]`` whose row i is the
    distribution node i's token was sampled from given its parent path (may be None for greedy trees)."""

    parents: list[int]
    token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    #: NEGATIVE CONTROL ONLY: verify by greedy match even when sampling (biased at T > 0; see
    #: :func:`greedy_match_verify_tree_path`).
    greedy_match: bool = False
    #: A chain's proposal for the round's last token: ``(token, q row)``, drawn from q after the last node. Sampled
    #: verification tests it as one more child of the last node (so, accepted with probability min(1, p/q), else the
    #: last token comes from the residual) without the target computing its row: the emitted token is still
    #: distributed as p, and equals the drafter's next token more often than an independent draw from p would.
    tail: tuple[int, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        n = len(self.parents)
        if len(self.token_ids) != n:
            raise ValueError(f"parents has {n} entries but token_ids has {len(self.token_ids)}")
        for i, par in enumerate(self.parents):
            if not -1 <= par < i:
                raise ValueError(f"node {i} has parent {par}; need -1 <= parent < own index (topological order)")
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n):
            raise ValueError(f"draft_probs must be [{n}, V], got {tuple(self.draft_probs.shape)}")
        if self.tail is not None and any(par != i - 1 for i, par in enumerate(self.parents)):
            raise ValueError("a tail follows a chain only")

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def depths(self) -> list[int]:
        out: list[int] = []
        for par in self.parents:
            out.append(1 if par < 0 else out[par] + 1)
        return out

    def children(self, i: int) -> list[int]:
        return [j for j, par in enumerate(self.parents) if par == i]

    def child_lists(self) -> list[list[int]]:
        """``out[i + 1]`` lists the children of node i in order (``out[0]``: the root's)."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for j, par in enumerate(self.parents):
            out[par + 1].append(j)
        return out

    def path_to(self, i: int) -> list[int]:
        path = []
        while i >= 0:
            path.append(i)
            i = self.parents[i]
        return path[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool, ``mask[i, j]``: j is i or an ancestor of i (tree attention among the new nodes)."""
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool)
        for i, par in enumerate(self.parents):
            if par >= 0:
                mask[i] |= mask[par]
        return mask

    @classmethod
    def chain(cls, token_ids: Sequence[int], draft_probs: torch.Tensor | None = None) -> TokenTree:
        return cls(list(range(-1, len(token_ids) - 1)), list(token_ids), draft_probs)


@dataclass(slots=True)
class SampledRound:
    """One sampled request's round to verify: its target rows ``probs [N+1, V]``, its tree (``draft_probs`` set)
    and its ``uniforms`` (at least N + 1, N + 2 with a tail), consumed as :func:`stochastic_verify_tree_path` does."""

    probs: torch.Tensor
    tree: TokenTree
    uniforms: torch.Tensor


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) row-wise, falling back to p where that is all zero (p <= q everywhere); no host sync."""
    res = normalise((p - q).clamp_min(0.0))
    return torch.where(res.sum(-1, keepdim=True) <= 0, p, res)


def greedy_verify_tree(target_logits: torch.Tensor, tree: TokenTree) -> list[int]:
    """Follow the child whose token is the target argmax (first such sibling) while one exists, then emit the
    argmax. ``target_logits [N+1, V]`` (probabilities work too)."""
    return greedy_verify_tree_path(target_logits, tree)[0]


def greedy_verify_tree_path(target_logits: torch.Tensor | list[int], tree: TokenTree) -> tuple[list[int], list[int]]:
    """:func:`greedy_verify_tree`, also returning the accepted node indices (root to leaf). ``target_logits`` may be
    the rows' argmaxes already on the host (what the engine passes: one download for the whole batch)."""
    rows = len(target_logits)
    if rows != tree.num_nodes + 1:
        raise ValueError(f"target_logits must have {tree.num_nodes + 1} rows, got {rows}")
    argmax = target_logits if isinstance(target_logits, list) else to_host(target_logits.argmax(-1))
    kids = tree.child_lists()
    out: list[int] = []
    path: list[int] = []
    cur = -1
    while True:
        a = argmax[cur + 1]
        nxt = next((c for c in kids[cur + 1] if tree.token_ids[c] == a), None)
        out.append(a)
        if nxt is None:
            return out, path
        path.append(nxt)
        cur = nxt


def stochastic_verify_tree(
    target_probs: torch.Tensor, tree: TokenTree, uniforms: torch.Tensor, sibling_recursion: bool = True
) -> list[int]:
    """Exact multi-branch speculative sampling; see :func:`stochastic_verify_tree_path`."""
    return stochastic_verify_tree_path(target_probs, tree, uniforms, sibling_recursion)[0]


def stochastic_verify_tree_path(
    target_probs: torch.Tensor, tree: TokenTree, uniforms: torch.Tensor, sibling_recursion: bool = True
) -> tuple[list[int], list[int]]:
    """Exact multi-branch speculative sampling (module docstring); returns the emitted tokens and the accepted
    node indices (siblings may share a token, so the path cannot be recovered from the tokens alone).

    Args:
        target_probs: ``[N+1, V]`` target distributions (row 0: root, row 1+i: children of node i).
        tree: with ``draft_probs``; row i must be the distribution node i was sampled from.
        uniforms: 1-D, at least N+1 uniforms in [0, 1) (N+2 with a ``tail``), consumed in order: one per acceptance
            test, one final draw.
        sibling_recursion: False is a NEGATIVE CONTROL ONLY (biased): every sibling is tested against the original
            p, and after all are rejected the last token comes from norm(max(0, p - q_last)).
    """
    n = tree.num_nodes
    dp = tree.draft_probs
    if dp is None and n > 0:
        raise ValueError("stochastic verification needs tree.draft_probs")
    if target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs must have {n + 1} rows, got {target_probs.shape[0]}")
    if uniforms.numel() < n + 1 + (tree.tail is not None):
        raise ValueError(f"need at least {n + 1 + (tree.tail is not None)} uniforms, got {uniforms.numel()}")
    kids = tree.child_lists()
    out: list[int] = []
    path: list[int] = []
    k = 0
    cur = -1
    while True:
        p = p_orig = target_probs[cur + 1]  # without recursion p stays p_orig
        q_last = None
        nxt = None
        for c in kids[cur + 1]:
            x = tree.token_ids[c]
            q = dp[c]  # type: ignore[index]
            accept = bool(uniforms[k] * q[x] < p[x])
            k += 1
            if accept:
                nxt = c
                break
            if sibling_recursion:
                p = residual(p[None], q[None])[0]
            q_last = q
        if nxt is None and tree.tail is not None and cur == n - 1:  # the end of the chain: test its tail
            x, q = tree.tail
            accept = bool(uniforms[k] * q[x] < p[x])
            k += 1
            if accept:
                out.append(x)
                return out, path
            p = residual(p[None], q[None])[0] if sibling_recursion else p
            q_last = q
        if nxt is None:
            if not sibling_recursion and q_last is not None:
                p = residual(p_orig[None], q_last[None])[0]
            out.append(int(sample_from_probs(p[None], uniforms[k : k + 1])[0]))
            return out, path
        out.append(tree.token_ids[nxt])
        path.append(nxt)
        cur = nxt


def greedy_match_verify_tree_path(
    target_probs: torch.Tensor, tree: TokenTree, uniform: torch.Tensor
) -> tuple[list[int], list[int]]:
    """NEGATIVE CONTROL ONLY: accept nodes equal to the target argmax, then sample the last token from p.

    This is how the reference implementation verifies its fast backup's tokens at T > 0. It is biased: a drafted
    token that equals the argmax is accepted with probability 1 instead of p(x).
    """
    _, path = greedy_verify_tree_path(target_probs, tree)
    row = target_probs[path[-1] + 1 if path else 0]
    last = int(sample_from_probs(row[None], uniform.view(1))[0])
    return [tree.token_ids[i] for i in path] + [last], path


def verify_trees(
    target_probs_list: Sequence[torch.Tensor],
    trees: Sequence[TokenTree],
    greedy_flags: Sequence[bool],
    uniforms_list: Sequence[torch.Tensor | None],
) -> list[list[int]]:
    """Per-request dispatch: greedy rows use :func:`greedy_verify_tree` (uniforms may be None), others stochastic."""
    if not len(target_probs_list) == len(trees) == len(greedy_flags) == len(uniforms_list):
        raise ValueError("verify_trees: argument lists differ in length")
    out = []
    for probs, tree, greedy, uni in zip(target_probs_list, trees, greedy_flags, uniforms_list, strict=True):
        if greedy:
            out.append(greedy_verify_tree(probs, tree))
        else:
            if uni is None:
                raise ValueError("stochastic rows need uniforms")
            out.append(stochastic_verify_tree(probs, tree, uni))
    return out
