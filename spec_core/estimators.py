"""Online estimators: Bernoulli rates (the drafter's leaf hit rates, the verifier's workload acceptance), the
fan-out inputs, acceptance rate a and power-law miss exponent r (with scale c), and a linear cost fit (a step's time
against its size: the verifier's steps, the drafter's bundle builds).

All keep exponentially weighted sufficient statistics: with a half-life of h trials (rounds) every update first
multiplies the stored weight by 2^(-n/h) for its n trials (``half_life=None`` keeps everything). They are
deterministic (no randomness).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

R_MIN, R_MAX = 0.05, 10.0


def _decay_factor(half_life: float | None) -> float:
    if half_life is None:
        return 1.0
    if not math.isfinite(half_life) or half_life <= 0:
        raise ValueError(f"half_life must be > 0 rounds or None, got {half_life!r}")
    return 0.5 ** (1.0 / half_life)


class RateEstimator:
    """A Bernoulli rate with exponentially weighted counts and a prior of ``prior_weight`` trials at ``prior``.

    The weight decays per trial, not per update: an update of n trials ages what came before by 2^(-n/h), and one
    of none ages nothing."""

    def __init__(self, prior: float, prior_weight: float = 5.0, half_life: float | None = 200.0) -> None:
        self._decay = _decay_factor(half_life)
        self._prior, self._prior_weight = prior, prior_weight
        self._hits = self._trials = 0.0

    def update(self, hit: bool) -> None:
        self.update_many(float(hit), 1.0)

    def update_many(self, hits: float, trials: float) -> None:
        """Record ``hits`` successes out of ``trials`` (0 <= hits <= trials)."""
        if trials < 0 or not 0 <= hits <= trials:
            raise ValueError(f"need 0 <= hits <= trials, got hits={hits}, trials={trials}")
        keep = self._decay**trials
        self._hits = self._hits * keep + hits
        self._trials = self._trials * keep + trials

    @property
    def trials(self) -> float:
        """The decayed number of trials seen (the prior's not included)."""
        return self._trials

    @property
    def value(self) -> float:
        return (self._hits + self._prior * self._prior_weight) / (self._trials + self._prior_weight)


class AcceptanceEstimator:
    """Per-token acceptance a from accepted counts of capped-geometric rounds (k accepted out of K drafted).

    MLE: every drafted position the verifier reached is a Bernoulli trial, so a = sum(accepted) / sum(trials) with
    trials = accepted + (1 if accepted < K else 0). The prior is ``prior_weight`` pseudo-rounds at ``prior_a`` with the
    most recent K: each adds E[accepted] = a0(1-a0^K)/(1-a0) and E[trials] = E[accepted] + 1 - a0^K, whose ratio is
    exactly a0 for any K. The prior does not decay; with a half-life h the data weight levels off near h/ln 2 rounds.
    """

    def __init__(self, half_life: float | None = 200.0, prior_a: float = 0.6, prior_weight: float = 5.0) -> None:
        if not 0.0 < prior_a < 1.0:
            raise ValueError(f"prior_a must be in (0, 1), got {prior_a!r}")
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight!r}")
        self._decay = _decay_factor(half_life)
        self._prior_a = prior_a
        self._prior_weight = prior_weight
        self._accepted = 0.0
        self._trials = 0.0
        self._last_k = 0

    def update(self, num_accepted: int, k: int) -> None:
        """Record one round: ``num_accepted`` of the ``k`` drafted tokens were accepted (0 <= num_accepted <= k)."""
        if k < 0 or not 0 <= num_accepted <= k:
            raise ValueError(f"need 0 <= num_accepted <= k, got num_accepted={num_accepted}, k={k}")
        self._accepted = self._accepted * self._decay + num_accepted
        self._trials = self._trials * self._decay + num_accepted + (1 if num_accepted < k else 0)
        self._last_k = k

    @property
    def value(self) -> float:
        """Posterior-mean-like estimate of a, in [0, 1]; the prior a0 until a round with k >= 1 arrives."""
        a0, k = self._prior_a, self._last_k
        prior_acc = self._prior_weight * a0 * (1.0 - a0**k) / (1.0 - a0)
        prior_trials = prior_acc + self._prior_weight * (1.0 - a0**k)
        trials = self._trials + prior_trials
        if trials <= 0.0:
            return a0
        return (self._accepted + prior_acc) / trials


class MissExponentEstimator:
    """Power-law miss model fitted from the rank of the realised bonus token among the drafter's candidates.

    Model (the paper's F^(-r) law with a free scale): P(R > F) = c·F^(-r) for F >= 1, where R is the 1-based rank of
    the true bonus token (None: not within the top ``max_rank``, i.e. R > max_rank). So P(R = 1) = 1 - c and the miss
    rate at fan-out F is ``miss_rate(F)``. Both parameters are fitted by maximum likelihood on the rank histogram:
    c = share of observations with R > 1 (closed form), and r maximises the likelihood of the tail
        sum_{j=2..M} n_j log((j-1)^(-r) - j^(-r)) - n_miss r log M,
    which is concave in r, so bisection on its derivative finds the unique maximiser; r is clamped to [0.05, 10].
    Until any R > 1 has been seen, r is ``prior_r``.
    """

    def __init__(self, max_rank: int = 16, half_life: float | None = 500.0, prior_r: float = 1.0) -> None:
        if max_rank < 2:
            raise ValueError(f"max_rank must be >= 2, got {max_rank!r}")
        if not R_MIN <= prior_r <= R_MAX:
            raise ValueError(f"prior_r must be in [{R_MIN}, {R_MAX}], got {prior_r!r}")
        self.max_rank = max_rank
        self._decay = _decay_factor(half_life)
        self._prior_r = prior_r
        self._counts = [0.0] * (max_rank + 2)  # index j = rank j (1..M); index M+1 = not in the top M
        self._cached: float | None = None

    def update(self, rank: int | None) -> None:
        """Record the 1-based rank of the realised bonus token; None (or a rank > max_rank, or inf) is a miss."""
        if rank is None or (isinstance(rank, float) and math.isinf(rank)) or rank > self.max_rank:
            idx = self.max_rank + 1
        elif rank >= 1:
            idx = int(rank)
        else:
            raise ValueError(f"rank must be >= 1 or None, got {rank!r}")
        if self._decay != 1.0:
            self._counts = [n * self._decay for n in self._counts]
        self._counts[idx] += 1.0
        self._cached = None

    @property
    def count(self) -> float:
        """Effective (decayed) number of observations."""
        return sum(self._counts[1:])

    @property
    def c(self) -> float:
        """Miss rate at fan-out 1, P(R > 1); 1.0 before any observation."""
        total = self.count
        return 1.0 if total <= 0.0 else 1.0 - self._counts[1] / total

    def _dloglik(self, r: float) -> float:
        """Derivative in r of the tail log-likelihood (see the class docstring)."""
        out = -self._counts[self.max_rank + 1] * math.log(self.max_rank)
        for j in range(2, self.max_rank + 1):
            n = self._counts[j]
            if n > 0.0:
                x1, x2 = math.log(j - 1), math.log(j)
                # d/dr log(e^{-r x1} - e^{-r x2}) = -x1 + (x2 - x1) / (e^{r (x2 - x1)} - 1)
                out += n * (-x1 + (x2 - x1) / math.expm1(r * (x2 - x1)))
        return out

    @property
    def r(self) -> float:
        """Maximum-likelihood miss exponent, clamped to [0.05, 10]."""
        if self._cached is None:
            self._cached = self._fit_r()
        return self._cached

    def _fit_r(self) -> float:
        if sum(self._counts[2:]) <= 0.0:
            return self._prior_r
        lo, hi = R_MIN, R_MAX
        if self._dloglik(lo) <= 0.0:
            return lo
        if self._dloglik(hi) >= 0.0:
            return hi
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if self._dloglik(mid) > 0.0:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    def miss_rate(self, fan_out: int) -> float:
        """Modelled P(true bonus token not among the top ``fan_out`` candidates): c·F^(-r), and 1 at F = 0."""
        if fan_out < 0:
            raise ValueError(f"fan_out must be >= 0, got {fan_out!r}")
        if fan_out == 0:
            return 1.0
        return min(1.0, self.c * fan_out ** (-self.r))


@dataclass(slots=True)
class LinearCost:
    """Exponentially weighted least squares fit of a step's time against its size (tokens, or work units)."""

    decay: float = 0.98
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, n: int, seconds: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + n, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + n * n, d * self.sxy + n * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(t0, t1), or None until the observations span more than one step size."""
        if self.sw < 2:
            return None
        var = self.sxx / self.sw - (self.sx / self.sw) ** 2
        if var <= 1e-9:
            return None
        t1 = (self.sxy / self.sw - self.sx * self.sy / self.sw**2) / var
        t0 = self.sy / self.sw - t1 * self.sx / self.sw
        return max(t0, 1e-6), max(t1, 0.0)

    def time(self, n: int) -> float | None:
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * n


#: Step sizes (tokens) a :class:`StepTimes` table covers: a K = 3 spine with leaves and a 2K-deep lookup branch.
STEP_TABLE_TOKENS = 24


@dataclass(slots=True)
class StepTimes:
    """A step's time by its size, measured per size: a forward's cost is a staircase, not a line (bf16 here: 3-6
    tokens within 5% of each other, then +13% at 7, then about 4% a token), which a line through all sizes prices
    wrong on both sides of the stair. Each size keeps an exponentially weighted mean; :meth:`table` fills the sizes
    not yet seen from ``fit`` (the line), so a size is measured once it is tried."""

    alpha: float = 0.2
    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, n: int, seconds: float) -> None:
        if 1 <= n <= STEP_TABLE_TOKENS:
            old = self.seconds.get(n)
            self.seconds[n] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def table(self, fit: LinearCost) -> list[float] | None:
        """Seconds for 1..:data:`STEP_TABLE_TOKENS` tokens (measured, else fitted); None before the fit exists."""
        c = fit.coefficients()
        if c is None:
            return None
        return [self.seconds.get(n, c[0] + c[1] * n) for n in range(1, STEP_TABLE_TOKENS + 1)]


@dataclass(slots=True)
class VerifyCosts:
    """What a verifier tells its drafter about its step's cost: the line through (tokens, seconds) of its verifies,
    the measured :class:`StepTimes` table and the last step's size. The table is made on demand, at most once a
    verify: only steps that send the drafter an outcome ask for it, so plain decoding does not pay for it."""

    fit: LinearCost = field(default_factory=lambda: LinearCost(decay=0.99))
    steps: StepTimes = field(default_factory=StepTimes)
    last_tokens: int = 1
    _table: list[float] | None = None
    _stale: bool = False

    def observe(self, tokens: int, seconds: float) -> None:
        self.fit.observe(tokens, seconds)
        self.steps.observe(tokens, seconds)
        self.last_tokens, self._stale = tokens, True

    def table(self) -> list[float] | None:
        """:meth:`StepTimes.table` as of the last verify."""
        if self._stale:
            self._table, self._stale = self.steps.table(self.fit), False
        return self._table

    def node_cost(self) -> float | None:
        """One more tree node's share of the last step (the fitted slope over the step's time), for the drafter's
        ``--tree auto``; None until the fit has seen more than one step size."""
        c = self.fit.coefficients()
        return None if c is None else c[1] / (c[0] + c[1] * self.last_tokens)
