"""Logits → probabilities and categorical draws: the one definition both drafter and verifier use.

Every function here is pure: randomness comes in as explicit uniforms, so a seeded caller is deterministic and
the same draw can be replayed anywhere. A temperature of 0 means greedy: such rows become one-hot at the argmax
(ties broken towards the lowest id, as ``torch.argmax`` does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spec_core.config import SamplingParams
from spec_core.transfer import to_device

#: Probabilities below this are treated as zero when normalising a residual.
_EPS = 1e-12


def logits_to_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    any_greedy: bool | None = None,
) -> torch.Tensor:
    """Turn logits into the sampling distribution.

    Args:
        logits: ``[B, ..., V]`` (fp32).
        temperature: ``[B]``; 0 means greedy (one-hot argmax).
        top_k: ``[B]`` int; 0 disables.
        top_p: ``[B]`` float in (0, 1]; 1 disables. Keeps the smallest top set whose mass reaches ``top_p``.
        any_greedy: whether some row has temperature 0, when the caller knows (None: read from ``temperature``).
    Returns:
        probs ``[B, ..., V]``, each row summing to 1.
    """
    shape = logits.shape
    bsz, vocab = shape[0], shape[-1]
    flat = logits.reshape(bsz, -1, vocab).float()
    temp = temperature.to(flat).view(bsz, 1, 1)
    greedy = temp <= 0
    scaled = flat / torch.where(greedy, torch.ones_like(temp), temp)
    if top_k is not None:  # rows with top_k 0 keep the whole vocabulary
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab).view(bsz, 1, 1)
        kth = torch.sort(scaled, dim=-1, descending=True).values.gather(-1, (k - 1).expand(bsz, flat.shape[1], 1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p is not None:
        probs = _apply_top_p(probs, top_p.to(probs).view(bsz, 1, 1))
    if greedy.any() if any_greedy is None else any_greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, flat.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy, onehot, probs)
    return probs.reshape(shape)


def request_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """:func:`logits_to_probs` with row b's temperature, top-k and top-p taken from ``params[b]``.

    The settings cross to the logits' device in one upload, and which filters apply is decided on the host (from
    ``params``), so no device value is read back.
    """
    rows = to_device([[p.temperature, p.top_k, p.top_p] for p in params], logits.device, torch.float32)
    top_k = rows[:, 1].long() if any(p.top_k > 0 for p in params) else None
    top_p = rows[:, 2] if any(p.top_p < 1 for p in params) else None
    return logits_to_probs(logits, rows[:, 0], top_k, top_p, any_greedy=any(p.greedy for p in params))


def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = mass_before < top_p  # the top token always has mass_before == 0
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: ``probs [N, V]`` (need not be normalised), ``uniform [N]`` in [0, 1) → ids ``[N]``.

    Never returns a zero-probability token, whatever the rounding of the cumulative sum.
    """
    cdf = torch.cumsum(probs.float(), dim=-1)
    total = cdf[:, -1:]
    # The cdf rises only at tokens with mass, so the first entry above a target below the total has mass. u · total
    # may round up to the total: such a target steps down to the float below it, and lands on the last token with
    # mass. No host sync, and no pass over the row besides the cumsum.
    target = torch.minimum(uniform.to(cdf).view(-1, 1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1).squeeze(-1)


def normalise(dist: torch.Tensor) -> torch.Tensor:
    return dist / dist.sum(-1, keepdim=True).clamp_min(_EPS)


def saguaro_downweight(probs: torch.Tensor, top_f: int, c: float) -> torch.Tensor:
    """Saguaro sampling q′: multiply the mass of the top-``top_f`` tokens by ``c`` ∈ (0, 1], then renormalise.

    Exact speculative sampling needs the verifier to use this same q′ in both the acceptance ratio and the residual;
    the drafter therefore ships q′ itself, never the raw q.
    """
    if not 0 < c <= 1:
        raise ValueError(f"Saguaro C must be in (0, 1], got {c}")
    if c == 1 or top_f <= 0:
        return probs
    top = torch.topk(probs, min(top_f, probs.shape[-1]), dim=-1).indices
    scale = torch.ones_like(probs).scatter_(-1, top, c)
    return normalise(probs * scale)


def truncate_top_n(probs: torch.Tensor, n: int) -> torch.Tensor:
    """Keep the ``n`` most likely tokens of each row and renormalise (``n <= 0``: unchanged).

    Any proposal distribution keeps speculative sampling exact as long as the verifier uses the one the token was
    drawn from, so the drafter may propose from this truncated q; its rows then travel as ``n`` (id, prob) pairs
    instead of the whole vocabulary.
    """
    if n <= 0 or n >= probs.shape[-1]:
        return probs
    top = torch.topk(probs, n, dim=-1)
    out = torch.zeros_like(probs).scatter_(-1, top.indices, top.values)
    return normalise(out)
