"""Serving policies from the SSD speedup model (paper §3 Theorem 7, §4.3 Corollary 16 / Theorem 17).

Time is measured in units of one verification (target forward over K+1 tokens at batch 1 for ``best_k``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

BackupKind = Literal["neural", "fast"]
MAX_BATCH = 1024


@dataclass(frozen=True, slots=True)
class BackupCost:
    """A backup speculator: expected tokens per round after a miss, and its serial latency / verify time."""

    e_miss: float
    t_b: float

    def __post_init__(self) -> None:
        if not math.isfinite(self.e_miss) or self.e_miss <= 0:
            raise ValueError(f"e_miss must be finite and > 0, got {self.e_miss!r}")
        if not math.isfinite(self.t_b) or self.t_b < 0:
            raise ValueError(f"t_b must be finite and >= 0, got {self.t_b!r}")


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens per SD round (bonus included) for i.i.d. acceptance a: (1 - a^(K+1)) / (1 - a)."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance a must be in [0, 1], got {a!r}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k!r}")
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def ssd_throughput(p_hit: float, b: int, e_hit: float, e_miss: float, t_p: float, t_b: float) -> float:
    """Tokens per unit time per sequence at batch size b (Corollary 16).

        [p·E_hit + (1-p)·E_miss] / [p^b·max(1, T_p) + (1 - p^b)·(1 + T_b)]

    A round stalls for the backup's latency T_b when any of the b sequences misses (probability 1 - p^b); otherwise it
    costs max(verify, primary tree build).
    """
    if not 0.0 <= p_hit <= 1.0:
        raise ValueError(f"p_hit must be in [0, 1], got {p_hit!r}")
    if b < 1:
        raise ValueError(f"batch size b must be >= 1, got {b!r}")
    if t_p < 0 or t_b < 0:
        raise ValueError(f"t_p and t_b must be >= 0, got t_p={t_p!r}, t_b={t_b!r}")
    all_hit = p_hit**b
    tokens = p_hit * e_hit + (1.0 - p_hit) * e_miss
    time = all_hit * max(1.0, t_p) + (1.0 - all_hit) * (1.0 + t_b)
    return tokens / time


def choose_backup(b: int, p_hit: float, e_hit: float, neural: BackupCost, fast: BackupCost, t_p: float) -> BackupKind:
    """The backup with the higher modelled throughput at batch size b; a tie keeps the neural backup."""
    thr_neural = ssd_throughput(p_hit, b, e_hit, neural.e_miss, t_p, neural.t_b)
    thr_fast = ssd_throughput(p_hit, b, e_hit, fast.e_miss, t_p, fast.t_b)
    return "fast" if thr_fast > thr_neural else "neural"


def crossover_batch(
    p_hit: float, e_hit: float, neural: BackupCost, fast: BackupCost, t_p: float, b_max: int = MAX_BATCH
) -> int | None:
    """b* (Theorem 17): the smallest batch size in 1..b_max at which the fast backup wins; None if it never does.

    Both throughputs are ratios of functions linear in q = p^b, so their difference changes sign at most once as b
    grows: neural below b*, fast from b* on.
    """
    for b in range(1, b_max + 1):
        if choose_backup(b, p_hit, e_hit, neural, fast, t_p) == "fast":
            return b
    return None


def best_k(a: float, c: float, verify_cost: Callable[[int], float], k_max: int) -> int:
    """Lookahead K in 0..k_max maximising the SD token rate E(K) / (V(K) + K·c); K = 0 is plain decoding (rate 1).

    ``c`` = T_draft(1) / T_verify(1) per drafted token; ``verify_cost(K)`` = V(K) = T_verify(K+1) / T_verify(1).
    Ties go to the smaller K (less wasted compute).
    """
    if c < 0:
        raise ValueError(f"draft cost c must be >= 0, got {c!r}")
    if k_max < 0:
        raise ValueError(f"k_max must be >= 0, got {k_max!r}")
    best, best_rate = 0, 1.0
    for k in range(1, k_max + 1):
        cost = verify_cost(k) + k * c
        if cost <= 0:
            raise ValueError(f"verify_cost({k}) + k*c must be > 0, got {cost!r}")
        rate = expected_tokens(a, k) / cost
        if rate > best_rate:
            best, best_rate = k, rate
    logger.debug("best_k(a=%.3f, c=%.3f): K=%d, rate %.3f tokens per verify", a, c, best, best_rate)
    return best
