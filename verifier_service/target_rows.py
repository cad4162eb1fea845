"""The target's decisions for a step's sampled requests, batched over requests: probabilities and plain draws for
the residual rule (:func:`sampled_rows`), race winners for coupled requests (:func:`coupled_rows`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spec_core.chain_verify import chain_outcomes, chain_results, is_chain
from spec_core.coupling import PendingPicks, coupling_keys, queue_picks
from spec_core.sampling import request_probs, sample_from_probs
from spec_core.sequence import VERIFY, Sequence
from spec_core.speculation import slot_positions
from spec_core.transfer import HostCopy, to_device
from spec_core.tree import SampledRound, TokenTree
from spec_core.tree_batch import tree_outcomes, tree_results


@dataclass(slots=True)
class SampledRows:
    """A step's sampled requests: each one's target probabilities ``[N+1, V]`` (by request id), for those with
    nothing to verify (a plain round) the token already drawn, and for those with a tree its verification
    (emitted tokens, accepted nodes; the whole step's chains at once by :func:`spec_core.chain_verify.chain_outcomes`,
    its other trees by :func:`spec_core.tree_batch.tree_outcomes`). ``picks`` and ``verified`` are filled by
    :meth:`resolve`, once the step's :class:`HostCopy` has fetched."""

    probs: dict[str, torch.Tensor] = field(default_factory=dict)
    picks: dict[str, int] = field(default_factory=dict)
    verified: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    #: (request ids, slot) of each group's plain draws, (request ids, rounds, slot) of the chains, (request ids,
    #: slot) of the other trees.
    _plain: list[tuple[list[str], int]] = field(default_factory=list)
    _chains: tuple[list[str], list[SampledRound], int] | None = None
    _trees: tuple[list[str], int] | None = None

    def resolve(self, down: HostCopy) -> SampledRows:
        """Read the draws and the trees' outcomes from ``down`` (fetched)."""
        for ids, slot in self._plain:
            self.picks.update(zip(ids, down[slot]))
        if self._chains is not None:
            ids, rounds, slot = self._chains
            self.verified.update(zip(ids, chain_results(rounds, down[slot])))
        if self._trees is not None:
            ids, slot = self._trees
            self.verified.update(zip(ids, tree_results(down[slot])))
        return self


def sampled_rows(logits: torch.Tensor, requests: list[tuple[int, Sequence, TokenTree]], down: HostCopy
                 ) -> SampledRows:
    """One :func:`request_probs` over every sampled request's rows (``(b, seq, tree)``: its batch row b of
    ``logits [B, L, V]`` and its tree), and one draw for every plain round among them, instead of a softmax and
    a draw per request (int4 at batch 16, T = 0.8: ITL 107.3 → 105.1 ms). Each row's arithmetic is its own, so the
    values are those of the per-request calls (requests are grouped by which top-k/top-p filters they use, since
    a filter runs on every row of a call); a plain round's draw uses its verification uniform, as
    :func:`stochastic_verify_tree_path` does for an empty tree (its uniforms and row indices cross up together). The
    draws and the trees' outcomes are queued on ``down``: :meth:`SampledRows.resolve` reads them after its fetch."""
    out = SampledRows()
    groups: dict[tuple[bool, bool], list[tuple[int, Sequence, TokenTree]]] = {}
    for b, seq, tree in requests:  # a filter applied to a whole call (top-k 0 or top-p 1 rows too) may round them
        groups.setdefault((seq.params.top_k > 0, seq.params.top_p < 1), []).append((b, seq, tree))  # differently
    for group in groups.values():
        index = to_device([[b for b, _, t in group for _ in range(t.num_nodes + 1)],
                           [i for _, _, t in group for i in range(t.num_nodes + 1)]], logits.device, torch.long)
        probs = request_probs(logits[index[0], index[1]][:, None],
                              [seq.params for _, seq, t in group for _ in range(t.num_nodes + 1)])[:, 0]
        start, plain = 0, []
        for _, seq, tree in group:
            out.probs[seq.request_id] = probs[start : start + tree.num_nodes + 1]
            if not tree.num_nodes and not tree.greedy_match:
                plain.append((seq, start))
            start += tree.num_nodes + 1
        if plain:
            up = to_device(torch.cat([seq.uniforms_at(seq.num_tokens, 1, VERIFY) for seq, _ in plain]
                                     + [torch.as_tensor([float(i) for _, i in plain])]), logits.device, torch.float32)
            drawn = sample_from_probs(probs[up[len(plain):].long()], up[: len(plain)])
            out._plain.append(([seq.request_id for seq, _ in plain], down.add(drawn)))
    _queue_trees(out, requests, down)
    return out


def _queue_trees(out: SampledRows, requests: list[tuple[int, Sequence, TokenTree]], down: HostCopy) -> None:
    """Queue the verification of every sampled tree on ``down``: the chains in one batch, the others in another."""
    chains: dict[str, SampledRound] = {}
    trees: dict[str, SampledRound] = {}
    for _, seq, tree in requests:
        if tree.num_nodes and not tree.greedy_match:
            uniforms = seq.uniforms_at(seq.num_tokens, tree.num_nodes + 1 + (tree.tail is not None), VERIFY)
            (chains if is_chain(tree) else trees)[seq.request_id] = SampledRound(out.probs[seq.request_id], tree,
                                                                                  uniforms)
    if chains:
        out._chains = (list(chains), list(chains.values()), down.add(chain_outcomes(list(chains.values()))))
    if trees:
        out._trees = (list(trees), down.add(tree_outcomes(list(trees.values()))))


def coupled_rows(logits: torch.Tensor, requests: list[tuple[int, Sequence, TokenTree]], down: HostCopy,
                 by_position: bool = True) -> CoupledRows:
    """Every coupled request's draw at each row of its tree (``(b, seq, tree)`` as in :func:`sampled_rows`), by
    request id, once ``down`` has fetched (:meth:`CoupledRows.resolve`): row 0 (the root) picks the token at
    position n = ``seq.num_tokens``, row i + 1 (node i, at depth d) the one at n + d, each the exact race winner of
    :func:`spec_core.coupling.queue_picks` under the request's seed. The tree is then verified as a greedy one is,
    against these picks. Requests are grouped by filters as in :func:`sampled_rows`; one upload of row indices and
    keys per group, the winners in the step's download. ``by_position=False`` is a NEGATIVE CONTROL (one noise for
    all of a request's tokens: biased)."""
    out = CoupledRows()
    groups: dict[tuple[bool, bool], list[tuple[int, Sequence, TokenTree]]] = {}
    for b, seq, tree in requests:
        groups.setdefault((seq.params.top_k > 0, seq.params.top_p < 1), []).append((b, seq, tree))
    for group in groups.values():
        rows, keys, params = [], [], []
        for b, seq, tree in group:
            rows.extend((b, i) for i in range(tree.num_nodes + 1))
            positions = slot_positions(seq.num_tokens, tree.parents)
            keys.extend(coupling_keys(seq.seed, positions if by_position else [0] * len(positions)))
            params.extend([seq.params] * (tree.num_nodes + 1))
        index = to_device([[b for b, _ in rows], [i for _, i in rows], *zip(*keys)], logits.device, torch.long)
        probs = request_probs(logits[index[0], index[1]][:, None], params)[:, 0]
        sizes = [(seq.request_id, tree.num_nodes + 1) for _, seq, tree in group]
        out.pending.append((sizes, queue_picks(probs, index[2:].T, down)))
    return out


@dataclass(slots=True)
class CoupledRows:
    """A step's coupled draws, queued: :meth:`resolve` reads them (by request id) after the step's fetch."""

    pending: list[tuple[list[tuple[str, int]], PendingPicks]] = field(default_factory=list)

    def resolve(self, down: HostCopy) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for sizes, pending in self.pending:
            picks, start = pending.read(down), 0
            for request_id, n in sizes:
                out[request_id] = picks[start : start + n]
                start += n
        return out
