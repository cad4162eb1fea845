"""Exact speculative sampling for chains, batched over requests with ragged draft lengths (pure tensor functions).

Vocabulary (as in vLLM): the output of one round for one request is ``accepted draft tokens`` followed by exactly
one more token, which is either the *recovered* token (sampled after a rejection) or the *bonus* token (sampled
from the target at position K+1 when all K drafts were accepted). Rows are padded with ``PLACEHOLDER = -1``.

Stochastic rule (Leviathan et al. 2023; Chen et al. 2023): accept draft token d_j with probability
min(1, p_j(d_j) / q_j(d_j)); on the first rejection sample from norm(max(0, p_j − q_j)); if all are accepted sample
the bonus from p_{K+1}. Then the emitted tokens are distributed exactly as the target's, for *any* proposal q
whose probabilities are known, which is why Saguaro's modified q′ stays lossless when q′ is what we pass here.

Greedy rule (temperature 0): accept the longest prefix equal to the target argmax, then emit the target argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_core.sampling import normalise, sample_from_probs

PLACEHOLDER = -1


@dataclass(frozen=True, slots=True)
class RejectionOutput:
    """``token_ids [B, K+1]`` (padded with -1) and ``num_accepted [B]`` draft tokens accepted per row.

    Row b emits ``token_ids[b, : num_accepted[b] + 1]``.
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor

    def parse(self) -> list[list[int]]:
        return [row[: int(n) + 1] for row, n in zip(self.token_ids.tolist(), self.num_accepted.tolist())]


def _valid_mask(num_draft: torch.Tensor, k: int) -> torch.Tensor:
    return torch.arange(k, device=num_draft.device)[None, :] < num_draft[:, None]


def _count_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of ``accept [B, K]``."""
    return torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)


def _assemble(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, last_token: torch.Tensor) -> RejectionOutput:
    bsz, k = draft_token_ids.shape
    out = torch.full((bsz, k + 1), PLACEHOLDER, dtype=torch.int64, device=draft_token_ids.device)
    cols = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    out[:, :k] = torch.where(cols[:, :k] < num_accepted[:, None], draft_token_ids, out[:, :k])
    out.scatter_(1, num_accepted[:, None], last_token[:, None])
    return RejectionOutput(out, num_accepted)


def greedy_verify(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft: torch.Tensor) -> RejectionOutput:
    """Greedy chain verification.

    Args:
        target_logits: ``[B, K+1, V]`` (or probabilities; only the argmax is used).
        draft_token_ids: ``[B, K]``; entries at or beyond ``num_draft[b]`` are ignored.
        num_draft: ``[B]`` number of real draft tokens per row (0..K).
    """
    argmax = target_logits.argmax(-1)
    k = draft_token_ids.shape[1]
    accept = (draft_token_ids == argmax[:, :k]) & _valid_mask(num_draft, k)
    num_accepted = _count_prefix(accept)
    return _assemble(draft_token_ids, num_accepted, argmax.gather(1, num_accepted[:, None]).squeeze(1))


def stochastic_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    accept_uniform: torch.Tensor,
    resample_uniform: torch.Tensor,
    residual_from_target: bool = False,
) -> RejectionOutput:
    """Exact stochastic chain verification.

    Args:
        target_probs: ``[B, K+1, V]`` target sampling distributions p_1..p_{K+1}.
        draft_probs: ``[B, K, V]`` the exact distributions the draft tokens were sampled from (q, or Saguaro q′).
        draft_token_ids: ``[B, K]``.
        num_draft: ``[B]`` real draft lengths; position ``num_draft[b]`` of ``target_probs`` is the bonus dist.
        accept_uniform: ``[B, K]`` uniforms in [0, 1).
        resample_uniform: ``[B]`` uniforms in [0, 1) for the recovered or bonus draw.
        residual_from_target: negative control only. Resample from p instead of the residual (biased).
    """
    bsz, k = draft_token_ids.shape
    p_d = target_probs[:, :k].gather(-1, draft_token_ids[..., None]).squeeze(-1)
    q_d = draft_probs.gather(-1, draft_token_ids[..., None]).squeeze(-1)
    accept = (accept_uniform * q_d <= p_d) & _valid_mask(num_draft, k)
    num_accepted = _count_prefix(accept)
    rows = torch.arange(bsz, device=target_probs.device)
    p_at = target_probs[rows, num_accepted]
    rejected = num_accepted < num_draft
    q_at = draft_probs[rows, num_accepted.clamp(max=k - 1)] if k > 0 else torch.zeros_like(p_at)
    residual = normalise((p_at - q_at).clamp_min(0.0))
    # p == q exactly cannot reject; guard the all-zero residual anyway by falling back to p.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    use_residual = rejected[:, None] & (not residual_from_target)
    dist = torch.where(use_residual, residual, p_at)
    last = sample_from_probs(dist, resample_uniform)
    return _assemble(draft_token_ids, num_accepted, last)


def verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    greedy: torch.Tensor,
    accept_uniform: torch.Tensor,
    resample_uniform: torch.Tensor,
) -> RejectionOutput:
    """Mixed batch: rows with ``greedy[b]`` use :func:`greedy_verify`, the others :func:`stochastic_verify`.

    For greedy rows ``target_probs`` may be one-hot (as :func:`logits_to_probs` gives at temperature 0).
    """
    if bool(greedy.all()):
        return greedy_verify(target_probs, draft_token_ids, num_draft)
    sto = stochastic_verify(target_probs, draft_probs, draft_token_ids, num_draft, accept_uniform, resample_uniform)
    if not bool(greedy.any()):
        return sto
    gre = greedy_verify(target_probs, draft_token_ids, num_draft)
    g = greedy[:, None]
    return RejectionOutput(torch.where(g, gre.token_ids, sto.token_ids), torch.where(greedy, gre.num_accepted, sto.num_accepted))
