"""Fan-out schedules: how many bonus-token guesses F_k the drafter caches for each outcome "k drafted tokens accepted".

After a speculation of K tokens the verifier returns (k, t*) with k in 0..K. The drafter pre-drafts continuations for
the F_k most likely bonus tokens t* at every k, under a per-request budget B = sum_k F_k.

Geometric fan-out (paper §4.1, Theorem 12). Acceptance is modelled as capped-geometric, P(k) = a^k (1 - a) for k < K
and P(K) = a^K, and the miss rate at one position as a power law, miss(F) = F^(-r). Maximising the expected hit rate
sum_k P(k) (1 - F_k^(-r)) subject to sum_k F_k = B gives F_k ∝ P(k)^(1/(1+r)); dropping the common factor (1-a):

    F_k ∝ a^(k/(1+r))                          for k < K
    F_K ∝ a^(K/(1+r)) · (1 - a)^(-1/(1+r))     (the "all accepted" outcome gets a boost)

A scale factor on the miss law (miss = c·F^(-r)) cancels out of these proportions. The real-valued schedule is rounded
to integers with the largest-remainder method, so the sum stays exactly B and each F_k is within 1 of its real value.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

A_MAX = 0.999
"""Acceptance is capped here so that the (1 - a)^(-1/(1+r)) boost at k = K stays finite."""

FanoutKind = Literal["geometric", "uniform"]


def _check_k_budget(k: int, budget: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"lookahead k must be an int >= 0, got {k!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")


def geometric_weights(k: int, a: float, r: float) -> list[float]:
    """Unnormalised real-valued geometric fan-out weights w_0..w_K (Theorem 12); ``a`` is clamped to [0, 0.999]."""
    if not math.isfinite(a) or not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance a must be in [0, 1], got {a!r}")
    if not math.isfinite(r) or r <= 0.0:
        raise ValueError(f"miss exponent r must be finite and > 0, got {r!r}")
    a = min(a, A_MAX)
    e = 1.0 / (1.0 + r)
    weights = [a ** (j * e) for j in range(k + 1)]  # 0.0 ** 0 == 1.0: a -> 0 puts everything on k = 0
    weights[k] *= (1.0 - a) ** (-e)
    return weights


def _largest_remainder(weights: list[float], budget: int) -> list[int]:
    """Integers proportional to ``weights`` summing exactly to ``budget``; ties in the remainder go to the lower k."""
    total = sum(weights)
    exact = [budget * w / total for w in weights]
    out = [math.floor(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda j: (-(exact[j] - out[j]), j))
    left = budget - sum(out)
    for i in range(left):  # 0 <= left <= K+1 (float round-off can only make it K+1, handled by the wrap)
        out[order[i % len(order)]] += 1
    return out


def geometric_fanout(k: int, budget: int, a: float, r: float) -> list[int]:
    """Geometric fan-out F_0..F_K (length K+1) for acceptance ``a`` and miss exponent ``r``, summing to ``budget``.

    F_0..F_{K-1} is non-increasing; F_K may exceed F_{K-1} (the boost). With B < K+1 some F_k are 0.
    """
    _check_k_budget(k, budget)
    weights = geometric_weights(k, a, r)
    fan = _largest_remainder(weights, budget)
    # The real weights are non-increasing for j < K and ties go to the lower k, so this sort is a safety net only
    # (against float round-off); it permutes values, so the sum is unchanged.
    head = sorted(fan[:k], reverse=True)
    if head != fan[:k]:
        logger.debug("geometric_fanout: reordered %s to keep F_k non-increasing", fan[:k])
    return head + fan[k:]


def uniform_fanout(k: int, budget: int) -> list[int]:
    """Uniform fan-out: F_k = B // (K+1) each, the remainder handed out one apiece to the lowest k first."""
    _check_k_budget(k, budget)
    base, rem = divmod(budget, k + 1)
    return [base + (1 if j < rem else 0) for j in range(k + 1)]


@dataclass(frozen=True, slots=True)
class FanoutConfig:
    """Which schedule to use and the per-request budget B = sum_k F_k (the number of cached branches)."""

    kind: FanoutKind = "geometric"
    budget: int = 12

    def __post_init__(self) -> None:
        if self.kind not in ("geometric", "uniform"):
            raise ValueError(f"fan-out kind must be 'geometric' or 'uniform', got {self.kind!r}")
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"fan-out budget must be an int >= 1, got {self.budget!r}")


def fanout_for(config: FanoutConfig, k: int, a: float, r: float) -> list[int]:
    """The schedule ``config`` asks for at lookahead ``k``; ``a`` and ``r`` are only used by the geometric kind."""
    if config.kind == "uniform":
        return uniform_fanout(k, config.budget)
    return geometric_fanout(k, config.budget, a, r)


RHO_MIN, RHO_MAX = 0.02, 0.98


def tree_fanout(config: FanoutConfig, k: int, leaves: list[int], a: float, r: float, rho: float,
                lookup_end: list[float] | None = None) -> list[int]:
    """Fan-out per outcome slot of a spine of ``k`` tokens with ``leaves[d]`` leaves beside spine node d
    (:class:`spec_core.config.TreeShape`) and a prompt-lookup branch: slots 0..k are the spine's (slot j: j spine
    tokens accepted), then one slot per leaf in node order (that leaf accepted), then one per lookup node
    (``lookup_end[m]``: the measured chance that a round ends on lookup node m). Without leaves or lookup nodes
    this is :func:`fanout_for`.

    ``rho`` is the chance that, the spine being rejected at a node with leaves, one of them is accepted (split
    evenly among them). The geometric weights then follow the same rule F ∝ P^(1/(1+r)) over the outcome
    probabilities: the spine slot j < k keeps P(j)(1 - rho) and each leaf at depth j + 1 gets P(j) rho / leaves[j];
    lookup node m gets lookup_end[m] (all relative to the weights' common factor 1 - a).
    """
    lookup_end = lookup_end or []
    if not any(leaves) and not lookup_end:
        return fanout_for(config, k, a, r)
    _check_k_budget(k, config.budget)
    n_slots = k + 1 + sum(leaves) + len(lookup_end)
    if config.kind == "uniform":
        return uniform_fanout(n_slots - 1, config.budget)
    rho = min(max(rho, RHO_MIN), RHO_MAX)
    e = 1.0 / (1.0 + r)
    w = geometric_weights(k, a, r)
    spine = [w[j] * ((1.0 - rho) ** e if j < len(leaves) and leaves[j] else 1.0) for j in range(k)] + [w[k]]
    side = [w[j] * (rho / leaves[j]) ** e for j in range(min(k, len(leaves))) for _ in range(leaves[j])]
    tail = [(min(max(p, 0.0), 1.0) / (1.0 - min(a, A_MAX))) ** e for p in lookup_end]
    return _largest_remainder(spine + side + tail, config.budget)
