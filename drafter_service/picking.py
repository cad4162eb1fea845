"""How the SSD drafter picks its tokens from a forward's logits: one per row (the spine and every branch), and the
leaves beside them. Greedy requests take the argmax and the next choices; sampled ones draw with uniforms keyed by
position (so a pre-drafted branch and a just-in-time draft from the same prefix pick the same tokens) and return
the exact rows they drew from, which the verifier's rejection test uses. Coupled requests (:mod:`spec_core.coupling`)
rank by their draft race (:func:`race_ranking`) and pick its winners, as greedy ones pick the argmax."""

from __future__ import annotations

import torch

from drafter_service.candidate_trees import leaf_tokens
from spec_core.config import SSDConfig
from spec_core.coupling import keyed_uniforms, keys_tensor
from spec_core.sampling import request_probs, saguaro_downweight, sample_from_probs, truncate_top_n
from spec_core.select import argmax_rows, topk_rows
from spec_core.sequence import DRAFT, DRAFT_LEAF, Sequence
from spec_core.transfer import to_device, to_host

#: Draft tokens in a coupled request's race (:func:`race_ranking`): its picks, leaves and bonus candidates.
RANK_HEAD = 32


def race_ranking(seq: Sequence, logits: torch.Tensor, positions: list[int], head: int = RANK_HEAD) -> list[list[int]]:
    """A coupled request's draft race at each row of ``logits [m, V]`` (row i keyed by ``positions[i]`` with the
    verifier's seed), on the host: the ``head`` likeliest draft tokens (within top-k), fastest first. It is the
    drafter's guess at the verifier's race (:mod:`spec_core.coupling`), so it leaves out what only exactness needs:
    the normaliser (common to a row), top-p and the tail. One top-k over the vocabulary per row, one download."""
    p = seq.params
    vals, ids = topk_rows(logits.float(), min(head if p.top_k <= 0 else min(head, p.top_k), logits.shape[-1]))
    u = keyed_uniforms(keys_tensor(seq.seed, positions, logits.device), ids)
    order = (vals / p.temperature - torch.log(-torch.log(u))).argsort(dim=-1, descending=True)
    return to_host(ids.gather(-1, order))


def pick_rows(config: SSDConfig, seq: Sequence, logits: torch.Tensor, positions: list[int], top_f: int
              ) -> tuple[list[int], torch.Tensor | None, list[list[int]] | None]:
    """One token per row of ``logits [m, V]``, all rows at once: argmax for greedy, else draws from Saguaro's q′
    (the top ``top_f`` tokens' mass scaled by C) truncated to the top-n (returned, ``[m, V]``: the exact rows the
    tokens were drawn from). Row i's token sits at ``positions[i]``; its uniform is keyed by that position. A
    coupled request takes its race's winner and also returns the race (:func:`race_ranking`, for its leaves)."""
    if seq.params.greedy:
        return to_host(argmax_rows(logits)), None, None
    if seq.params.coupled:
        ranked = race_ranking(seq, logits, positions)
        return [r[0] for r in ranked], None, ranked
    uniforms = to_device(seq.uniforms_for(positions, 1, DRAFT), logits.device)
    n, vocab = config.proposal_top_n, logits.shape[-1]
    if not 0 < n < vocab:
        q = request_probs(logits[None], [seq.params])[0]
        q_prime = truncate_top_n(saguaro_downweight(q, top_f, config.saguaro_c), n)
        return to_host(sample_from_probs(q_prime, uniforms)), q_prime, None
    # Work on the top-n logits only: the proposal is the (temperature, top-k/top-p, Saguaro) distribution over the
    # draft's n likeliest tokens, scattered back into vocabulary-sized rows for the verifier.
    vals, idx = topk_rows(logits.float(), n)
    small = saguaro_downweight(request_probs(vals[None], [seq.params])[0], top_f, config.saguaro_c)
    local = sample_from_probs(small, uniforms)
    toks = to_host(idx.gather(-1, local[:, None])[:, 0])
    q_prime = torch.zeros(logits.shape[0], vocab, device=logits.device).scatter_(-1, idx, small)
    return toks, q_prime, None


def pick_leaves(seq: Sequence, logits: torch.Tensor, spine: list[int], q: torch.Tensor | None,
                positions: list[int], extra: int, ranked: list[list[int]] | None = None
                ) -> list[tuple[list[int], torch.Tensor | None]]:
    """``extra`` leaves beside each row's spine token: the draft's next choices for a greedy request; for a sampled
    one, independent draws (with replacement, keyed uniforms) from the row the spine token was drawn from, which is
    what sibling recursion in the verifier needs to stay exact; for a coupled one, the next racers in ``ranked``."""
    if not extra:
        return [([], None) for _ in spine]
    if ranked is not None:
        return [([t for t in row if t != tok][:extra], None) for row, tok in zip(ranked, spine)]
    if q is None:
        return [(t, None) for t in leaf_tokens(logits, spine, extra)]
    # One draw for every row's leaves: a row's inverse-CDF draw is its own arithmetic, whatever rows share the call.
    uniforms = to_device(seq.uniforms_for(positions, extra, DRAFT_LEAF), q.device)
    drawn = to_host(sample_from_probs(q.repeat_interleave(extra, 0), uniforms))
    # each leaf keeps a view of its row (no copy), as the tree holds them until the bundle is sent
    return [(drawn[i * extra:(i + 1) * extra], row[None].expand(extra, -1)) for i, row in enumerate(q)]
