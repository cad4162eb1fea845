"""Fan-out schedules (Theorem 12), online a / r estimators, backup and lookahead policies (Corollary 16, Theorem 17)."""

from __future__ import annotations

import numpy as np
import pytest

from spec_core.estimators import AcceptanceEstimator, MissExponentEstimator, RateEstimator
from spec_core.fanout import FanoutConfig, fanout_for, geometric_fanout, geometric_weights, uniform_fanout
from spec_core.policy import BackupCost, best_k, choose_backup, crossover_batch, expected_tokens, ssd_throughput

KS = range(0, 9)
BUDGETS = [0, 1, 2, 3, 5, 7, 12, 20, 24, 37, 64]
ACCEPTS = [0.0, 1e-6, 0.1, 0.3, 0.6, 0.64, 0.85, 0.999, 1.0]
EXPONENTS = [0.05, 0.3, 1.0, 2.0, 10.0]


def test_geometric_sums_to_budget_and_head_non_increasing() -> None:
    for k in KS:
        for budget in BUDGETS:
            for a in ACCEPTS:
                for r in EXPONENTS:
                    fan = geometric_fanout(k, budget, a, r)
                    assert len(fan) == k + 1 and sum(fan) == budget and min(fan) >= 0, (k, budget, a, r, fan)
                    assert all(fan[j] >= fan[j + 1] for j in range(k - 1)), (k, budget, a, r, fan)
                    exact = [budget * w / sum(geometric_weights(k, a, r)) for w in geometric_weights(k, a, r)]
                    assert all(abs(f - x) < 1.0 + 1e-9 for f, x in zip(fan, exact)), (fan, exact)


def test_geometric_boost_at_k() -> None:
    # Real-valued schedule: the all-accepted outcome is boosted above k = K-1 ...
    w = geometric_weights(4, 0.6, 1.0)
    assert w[4] > w[3]
    # ... but largest-remainder rounding of 20 * w / sum(w) = [5.87, 4.54, 3.52, 2.73, 3.34] ties F_3 = F_4 = 3.
    fan = geometric_fanout(4, 20, 0.6, 1.0)
    assert fan == [6, 5, 3, 3, 3] and fan[4] >= fan[3]
    # Notes' example (K=4, B=20, a=0.64, r=1): ratios 1 : .8 : .64 : .512 : .41/sqrt(.36) = .683
    # (a^(k/(1+r)) = .64^(k/2); the notes' integer guess [6,5,4,3,2+] ignores the boost when normalising).
    ratios = [1.0, 0.8, 0.64, 0.512, 0.64**2 / 0.36**0.5]
    assert geometric_weights(4, 0.64, 1.0) == pytest.approx(ratios)
    fan = geometric_fanout(4, 20, 0.64, 1.0)
    expected = [round(20 * x / sum(ratios)) for x in ratios]
    assert all(abs(f - e) <= 1 for f, e in zip(fan, expected)), (fan, expected)
    assert fan == [5, 4, 4, 3, 4] and fan[4] > fan[3]


def test_geometric_limits() -> None:
    assert geometric_fanout(4, 20, 0.0, 1.0) == [20, 0, 0, 0, 0]  # a -> 0: everything on k = 0
    assert geometric_fanout(4, 20, 1.0, 1.0) == geometric_fanout(4, 20, 0.999, 1.0)  # a capped at 0.999
    assert geometric_fanout(4, 20, 1.0, 1.0)[4] > 10  # the boost dominates as a -> 1
    assert geometric_fanout(0, 7, 0.5, 1.0) == [7]
    assert geometric_fanout(4, 3, 0.6, 1.0).count(0) >= 2  # B < K+1
    for bad in [(-1, 5, 0.5, 1.0), (3, -1, 0.5, 1.0), (3, 5, 1.5, 1.0), (3, 5, 0.5, 0.0), (3, 5, float("nan"), 1.0)]:
        with pytest.raises(ValueError):
            geometric_fanout(*bad)


def test_uniform_and_config() -> None:
    for k in KS:
        for budget in BUDGETS:
            fan = uniform_fanout(k, budget)
            assert sum(fan) == budget and len(fan) == k + 1 and max(fan) - min(fan) <= 1
            assert fan == sorted(fan, reverse=True)  # remainder to the lowest k first
    assert uniform_fanout(3, 10) == [3, 3, 2, 2]
    assert fanout_for(FanoutConfig("uniform", 24), 7, 0.6, 1.0) == [3] * 8
    assert fanout_for(FanoutConfig(budget=20), 4, 0.64, 1.0) == geometric_fanout(4, 20, 0.64, 1.0)
    with pytest.raises(ValueError, match="kind"):
        FanoutConfig("tree", 12)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget"):
        FanoutConfig("geometric", 0)


def _capped_geometric(rng: np.random.Generator, a: float, k: int, n: int) -> np.ndarray:
    return np.minimum(rng.geometric(1.0 - a, size=n) - 1, k)


@pytest.mark.parametrize("a", [0.3, 0.6, 0.85])
def test_acceptance_estimator_converges(a: float) -> None:
    rng = np.random.default_rng(1234)
    est = AcceptanceEstimator(half_life=None)
    assert est.value == pytest.approx(0.6)  # the prior before any data
    for n in _capped_geometric(rng, a, 5, 4000):
        est.update(int(n), 5)
    assert abs(est.value - a) < 0.05


def test_acceptance_estimator_tracks_drift() -> None:
    rng = np.random.default_rng(7)
    est = AcceptanceEstimator(half_life=100.0)
    for a in (0.3, 0.85):
        for n in _capped_geometric(rng, a, 5, 1500):
            est.update(int(n), 5)
    assert abs(est.value - 0.85) < 0.05
    with pytest.raises(ValueError):
        est.update(6, 5)


def _power_law_ranks(rng: np.random.Generator, r: float, c: float, n: int, max_rank: int) -> list[int | None]:
    """Ranks with P(R > F) = c·F^(-r) for integers F >= 1: R = 1 w.p. 1-c, else R = ceil(U^(-1/r)), U ~ (0, 1].

    (floor(U^(-1/r)) would give P(R > F) = (F+1)^(-r) instead, a shifted law.)
    """
    u = 1.0 - rng.random(n)  # (0, 1]
    ranks = np.ceil(u ** (-1.0 / r))
    ranks[rng.random(n) >= c] = 1
    return [int(x) if x <= max_rank else None for x in ranks]


@pytest.mark.parametrize(("r", "c"), [(0.7, 1.0), (1.5, 1.0), (1.0, 0.4)])
def test_miss_exponent_estimator_converges(r: float, c: float) -> None:
    rng = np.random.default_rng(99)
    est = MissExponentEstimator(max_rank=16, half_life=None)
    assert est.r == 1.0 and est.miss_rate(0) == 1.0  # prior before data
    for rank in _power_law_ranks(rng, r, c, 20000, 16):
        est.update(rank)
    assert abs(est.r - r) < 0.05
    assert abs(est.c - c) < 0.02
    assert est.miss_rate(4) == pytest.approx(est.c * 4 ** (-est.r))


def test_miss_exponent_clamps() -> None:
    est = MissExponentEstimator(max_rank=8, half_life=None)
    for _ in range(50):
        est.update(None)
    assert est.r == 0.05 and est.c == 1.0
    est = MissExponentEstimator(max_rank=8, half_life=None)
    for _ in range(50):
        est.update(2)
    assert est.r == 10.0
    with pytest.raises(ValueError):
        est.update(0)


def test_backup_choice_flips_at_crossover() -> None:
    fast = BackupCost(e_miss=1.0, t_b=0.0)
    crossings = []
    for t_b in (0.05, 0.1, 0.2, 0.4):
        neural = BackupCost(e_miss=3.5, t_b=t_b)
        b_star = crossover_batch(0.95, 4.0, neural, fast, t_p=0.8)
        assert b_star is not None and b_star > 1
        assert choose_backup(b_star - 1, 0.95, 4.0, neural, fast, 0.8) == "neural"
        assert choose_backup(b_star, 0.95, 4.0, neural, fast, 0.8) == "fast"
        assert [choose_backup(b, 0.95, 4.0, neural, fast, 0.8) for b in range(1, 200)] == (
            ["neural"] * (b_star - 1) + ["fast"] * (200 - b_star)
        )
        crossings.append(b_star)
    assert crossings == sorted(crossings, reverse=True) and len(set(crossings)) == len(crossings)  # strictly lower
    assert crossover_batch(0.9, 4.0, BackupCost(3.5, 0.05), fast, 0.8) is None
    assert ssd_throughput(1.0, 64, 4.0, 1.0, 0.8, 5.0) == pytest.approx(4.0)  # all hits: no backup stall
    with pytest.raises(ValueError):
        BackupCost(e_miss=1.0, t_b=-0.1)


def test_best_k() -> None:
    assert expected_tokens(0.5, 0) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.6, 3) == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    assert best_k(0.01, 0.5, lambda k: 1.0 + 0.05 * k, 8) == 0
    high = best_k(0.9, 0.02, lambda k: 1.0 + 0.02 * k, 16)
    mid = best_k(0.6, 0.1, lambda k: 1.0 + 0.02 * k, 16)
    assert high >= 6 and 1 <= mid < high
    assert best_k(0.9, 0.02, lambda k: 1.0, 0) == 0


def test_rate_estimator_decays_per_trial_in_batches() -> None:
    """An update of n trials ages what came before by 2^(-n/h), its own trials all count in full, one of no trials
    ages nothing, and a single update is a batch of one."""
    d = 0.5 ** (1 / 16)
    single, batched = RateEstimator(0.7, 8.0, half_life=16.0), RateEstimator(0.7, 8.0, half_life=16.0)
    for hit in (True, False, True):
        single.update(hit)
        batched.update_many(float(hit), 1)
    assert batched.value == single.value and batched.trials == pytest.approx(1 + d + d * d)
    batched.update_many(2, 5)
    assert batched.trials == pytest.approx((1 + d + d * d) * d**5 + 5)
    before = batched.value
    batched.update_many(0, 0)
    assert batched.value == before and RateEstimator(0.7).value == pytest.approx(0.7)
    many = RateEstimator(0.7, 8.0, half_life=16.0)
    many.update_many(300, 1000)
    assert many.value == pytest.approx((300 + 5.6) / (1000 + 8))
    with pytest.raises(ValueError, match="0 <= hits <= trials"):
        many.update_many(3, 2)
