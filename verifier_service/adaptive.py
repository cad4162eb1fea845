"""Adaptive speculation: pick K per step (for the batch) and per request from measured costs, down to 0.

Cost model: the engine's whole step time (proposing, verifying, tree bookkeeping and rejection, not just the
forward) is fitted online as T(n) = t0 + t1·n over the tokens n of each step (exponentially weighted least
squares, so it follows load changes). With b requests in a step, V(K) = T(b·(K+1)) / T(b) is the cost of a step
with K drafted tokens per request relative to plain decoding, and :func:`spec_core.policy.best_k`
maximises E(a, K) / (V(K) + K·c) over K in 0..k_max. Because drafting is inside the measured step (an in-process
SD drafter; SSD's waits and bundle handling), ``c`` is 0 by default; a caller that measures drafting elsewhere may
set it. Fitting the forward alone ignored per-token costs outside it, which on small models are most of a step,
and kept K too high at concurrency 16. Acceptance ``a`` is
estimated per request (accepted / drafted with a prior), and the batch K uses the batch mean. The prior is the
workload's: the acceptance of every request's drafted tokens so far (exponentially weighted, with a half-life of
``population_half_life`` drafted tokens, so steps that draft nothing do not age it), itself shrunk towards
``prior_a``; so on a workload where drafts are rarely accepted (sampled chat at batch 16: 0.33) a new request starts
where its predecessors ended instead of at 0.7. K = 0 means plain decoding for that request; it re-probes
speculation every ``probe_every`` rounds after its first (unless the back-off below has measured speculation losing
at this batch size) so a request whose text turns
predictable gets K back. The other way round, while the batch speculates, every ``probe_plain_every``-th step is a
plain one (K = 0 for all): without steps of b tokens the fit only sees b·(K+1)-token steps, cannot tell the fixed
cost from the per-token one, and never learns that speculating (with its waits and bookkeeping) costs more than it
gains, as it does for sampled requests at batch 16 on a CPU. Such a step costs more than its own plain round: its
outcome has no pre-drafted bundle, so the round after it misses too. Every 16th step cost batch-1 greedy SSD 1-5%
(bf16: 2.14x and 2.19x AR against 2.25x and 2.22x at every 48th; w8a8: 1.61x against 1.68x), and the
fit, whose memory is about 50 steps (``LinearCost.decay``), still spans K's own step sizes in between.

The guard's plain steps are measured, not fitted: :meth:`AdaptiveK.plain_time` is the measured time of plain
decode steps of b requests (exponentially weighted; for a batch size not yet seen plain, the fit scaled by the last
measured/fitted ratio). A step's cost is not linear in its tokens: at batch 16 in bf16, plain steps of 16 tokens
took 105-150 ms and speculating steps of 25-58 tokens all about 200 ms, so the line through them put T(16) at
200-260 ms and every speculating step looked 1.6-2x as productive as plain decoding when it was 0.86x. (The
planner's V(K) keeps the fit: with the measured plain time as its denominator, batch-1 greedy SSD planned lower K
and ran 1.58x AR against 1.67-1.73x.)

SSD waits that no hit could have avoided (a new request's drafter is still on its prompt; a re-probe after plain
rounds asked the drafter for nothing, though such rounds no longer wait: ``SSDRequestState.draft_can_come``) are
left out of the fit (``cold_s`` in :meth:`AdaptiveK.observe_step`). Fitted in, they made a K = 1 step cost 2x a
plain one on w8a8 (a 19 ms verify, 15-20 ms of such waits), so the planner chose K = 0, re-probed only into more
such waits, and stayed plain on about 40% of its rounds.

Measured back-off. The model above predicts; the guard checks. A window's goodput is the plain-decoding time of the
tokens its speculating steps emitted over the time they took, ``Σ (emitted / b) · T(b) / Σ step_s`` (plain decoding
scores 1). A window is ``probe_window`` request-rounds of speculating steps, after ``warmup`` of them skipped (the
drafter catches up after idling) (:meth:`AdaptiveK.window`: 24 and 6 steps at batch 1, 6 and 2 at 16). A window
below ``min_gain`` sends the whole batch to plain decoding for ``hold`` steps, doubling on each failed window up to
``max_hold`` (and halving with each window of steps that pays, so one lucky window does not undo the failed ones);
then it speculates again and re-measures: the window after a hold runs requests at K >= 1 (a share of them under
load, below) whatever the acceptance estimates say, since estimates that only move with drafted tokens would
otherwise keep a batch plain for good once they fell (as after a cold drafter's first rounds, whose misses drag the
workload's acceptance down while the guard stops per-request re-probes). So wherever the estimates are wrong (a
prior that flatters acceptance, costs outside the step), the batch still runs no slower than plain decoding by more
than the probing costs. ``backoffs`` and ``backoff_steps`` count it.
Clear losses. A window that measures below ``clear_loss`` (0.9x) grows the hold 4x instead of 2x, and a window
whose first third already reads below ``early_loss`` (0.8x) is judged there. Sampled int4 on text far from the
draft's (T = 0.8, ``ood``, batch 1) measured its windows at 0.77-0.94x; each probe (warm-up and window, 30 steps
at batch 1) cost about 9 plain steps, and each speculating step also slowed the next few plain ones (by 0.5-1 ms
at 11 ms, while the drafter's late bundles arrive and it stops), which no window sees. Near break-even (0.9-1x)
the hold still doubles, and a window that pays is never cut short: at batch 1 a dozen steps of speculation that
pays 1.7x read below 1x now and then, but not below 0.8x over 8 steps.
The back-off's state is kept per range of batch sizes (:func:`batch_bucket`): speculation that loses at 16 in
flight may pay at 1, so a hold learned under load does not stop a lone request from speculating, nor the reverse.
Probes at a share of the batch. A probe's cost grows with the requests it makes speculate, and under load most
probes measure a loss (sampled requests at batch 16 on a CPU: a K = 1 step for all 16 cost 1.2-1.4x a plain one
for about 1.15x its tokens, and the ~15 such steps of a 512-step run were about half of SSD's 2% behind AR). So at b
requests a step, the window after a hold floors K at 1 only for the ``ceil(probe_share · b)`` requests with the
highest estimated acceptance (the ones likeliest to pay; all of them at batch 1), and per-request re-probes rotate:
at each re-probe round one of ``round(1 / probe_share)`` groups (at most b) of the batch re-probes, so a request
re-probes every ``probe_every · groups`` rounds. A probe then costs about a quarter of a whole-batch one and still
asks the question that matters at the margin: whether speculating some requests pays for them.
Plain decoding on both cores. Where the engine lends the drafter's core to plain steps
(:mod:`verifier_service.core_lending`; ``lend_after`` is then its streak), those steps' times are measured apart
(``lent_s``: they stay out of the fit and of the one-core plain time), and the guard's baseline is the faster of
the two plain decodings: speculation must beat AR on the cores SSD holds. Sampled chat at batch 1 ran 1.18x AR
while AR on both cores ran 1.65x. A batch size without a lent measurement gets one: a window that pays is followed
by a short hold (``lend_after`` + ``lend_probe_steps`` plain steps, the last ones lent), and again every
``lend_probe_every`` steps; the first lend probe of a batch size comes before its first window, so that the window is
judged against both cores. The batch's own K (not each request's: a request alone at K = 0 gets no lending while
others speculate) is planned against the lent plain step too, until a window measures speculation paying against it
(E(a, K) undercounts where acceptances come in runs). On the default pair's demo chat (int4, batch 1, where the
draft is rarely accepted) SSD ran 0.83-0.84x AR on both cores so, against 0.66-0.75x with its first window
judged against one core, the batch planned against one core and lent steps kept as a running mean; at T = 0.8 on
code 1.22-1.23x AR against 1.17-1.19x; greedy code, where SSD is at par with AR on both cores, 1.29-1.30x AR
against 1.31-1.39x (within its noise).
``lent_s`` is the median of the last ``lend_probe_steps`` lent steps, not a running mean: the first lent steps after
speculation may meet a drafter still at work on its core, and on the default pair (int4 chat at batch 1) three of
them once measured 12.3 ms against 5-6 ms in steady lending, which left the guard judging against one core for the
next 512 steps while SSD ran 0.7x AR on both cores. Where lending measures no faster than one core, it is measured
again sooner (after ``lend_probe_soon`` steps, doubling up to ``lend_probe_every``).
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field

from spec_core.estimators import LinearCost, RateEstimator
from spec_core.policy import best_k

logger = logging.getLogger(__name__)


def batch_bucket(b: int) -> int:
    """Batch sizes that share one back-off state: 1, 2-3, 4-7, 8-15, 16-31, ..."""
    return max(1, b).bit_length()


@dataclass(slots=True)
class Backoff:
    """The measured back-off for one range of batch sizes: the last window's goodput, the current window's sums
    (the plain-decoding time of the tokens its steps emitted, and the time they took), the speculating steps
    since the last hold, the steps left in a hold, the last hold's length (which doubles after each failed window),
    and whether the current window is the re-measurement after a hold (it speculates at K >= 1 until it is
    complete)."""

    gain: float | None = None
    plain_equiv_s: float = 0.0
    spent_s: float = 0.0
    window_steps: int = 0
    hold_left: int = 0
    next_hold: int = 0
    probing: bool = False


@dataclass(slots=True)
class AdaptiveK:
    k_max: int
    draft_cost: float = 0.0  # c: drafting time per token / T(batch) not already inside the measured step
    prior_a: float = 0.7
    prior_weight: float = 8.0
    #: The workload prior (module docstring): the acceptance of all requests' drafted tokens, decayed by drafted
    #: tokens (made from ``prior_a``, ``prior_weight`` and ``population_half_life``), and each request's counts
    #: at the last step (the deltas feed it; finished requests drop out).
    population_half_life: float = 512.0
    population: RateEstimator | None = None
    last_counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    probe_every: int = 16
    #: The share of a step's requests that the window after a hold, and each re-probe round, speculate on
    #: (module docstring, "Probes at a share of the batch").
    probe_share: float = 0.25
    probe_plain_every: int = 48
    cost: LinearCost | None = None
    batch_k: int = 0
    steps: int = 0
    #: Steps this planner ran with K = 0 for the whole batch, and requests' rounds it planned at K = 0.
    plain_steps: int = 0
    plain_rounds: int = 0
    #: The measured back-off (module docstring): its window, threshold and hold, its state and its counts.
    probe_window: int = 24
    warmup: int = 6
    min_gain: float = 1.0
    #: A window below ``clear_loss`` grows the hold 4x instead of 2x; one whose first third reads below
    #: ``early_loss`` is judged then (module docstring, "Clear losses").
    clear_loss: float = 0.9
    early_loss: float = 0.8
    hold: int = 48
    max_hold: int = 512
    backoff_by_bucket: dict[int, Backoff] = field(default_factory=dict)
    backoffs: int = 0
    backoff_steps: int = 0
    #: Measured plain decode steps: seconds by batch size (exponentially weighted), and measured / fitted.
    plain_s: dict[int, float] = field(default_factory=dict)
    plain_ratio: float = 1.0
    #: Plain steps on both cores (module docstring): the engine's streak before it lends (None: it does not), their
    #: seconds by batch size (the median of the last ``lend_probe_steps``, kept beside those samples), the step of
    #: each bucket's last lent step or lend probe, the lend probes' length and spacing, and their count.
    lend_after: int | None = None
    lent_s: dict[int, float] = field(default_factory=dict)
    lent_samples: dict[int, list[float]] = field(default_factory=dict)
    lent_at: dict[int, int] = field(default_factory=dict)
    lend_probe_steps: int = 8
    lend_probe_soon: int = 64
    lend_probe_every: int = 512
    lend_wait: dict[int, int] = field(default_factory=dict)
    lend_probes: int = 0

    def __post_init__(self) -> None:
        if self.cost is None:
            self.cost = LinearCost()
        if self.population is None:
            self.population = RateEstimator(self.prior_a, self.prior_weight, self.population_half_life)
        self.batch_k = self.k_max

    def backoff(self, b: int) -> Backoff:
        """The back-off state for steps of ``b`` requests (:func:`batch_bucket`)."""
        return self.backoff_by_bucket.setdefault(batch_bucket(b), Backoff())

    def prior(self) -> float:
        """The workload's acceptance so far, shrunk towards ``prior_a`` with ``prior_weight`` drafted tokens."""
        return self.population.value

    def acceptance(self, num_accepted: int, num_drafted: int) -> float:
        return (num_accepted + self.prior() * self.prior_weight) / (num_drafted + self.prior_weight)

    def _observe_population(self, accept: dict[str, tuple[int, int, int]]) -> None:
        """Add each request's accepted/drafted tokens since the last step to the workload's decayed sums."""
        new_a = new_n = 0
        for rid, (a, n, _) in accept.items():
            pa, pn = self.last_counts.get(rid, (0, 0))
            new_a, new_n = new_a + max(0, a - pa), new_n + max(0, n - pn)
        self.last_counts = {rid: (a, n) for rid, (a, n, _) in accept.items()}
        self.population.update_many(min(new_a, new_n), new_n)

    def plain_time(self, b: int) -> float | None:
        """T(b): the measured time of a plain decode step of ``b`` requests (module docstring)."""
        if b in self.plain_s:
            return self.plain_s[b]
        fitted = self.cost.time(b)
        return None if fitted is None else fitted * self.plain_ratio

    def baseline(self, b: int) -> float | None:
        """The guard's plain step of ``b`` requests: on one core (:meth:`plain_time`) or, where measured faster,
        on both (``lent_s``)."""
        t, lent = self.plain_time(b), self.lent_s.get(b)
        return t if lent is None else (lent if t is None else min(t, lent))

    def _lent_scale(self, b: int) -> float:
        """How much faster a plain step of ``b`` requests runs lent than on one core: the batch's K is planned
        against plain decoding on both cores, what a plain batch gets. 1 where lending is not measured faster, or
        where the guard's last window measured speculation paying against it (the measurement over the model:
        E(a, K) undercounts where acceptances come in runs)."""
        lent, plain, st = self.lent_s.get(b), self.plain_time(b), self.backoff(b)
        if lent is None or plain is None or lent >= plain or (st.gain is not None and st.gain >= self.min_gain):
            return 1.0
        return plain / lent

    def _v(self, b: int):
        t_b = self.cost.time(b)
        if t_b is None:
            return None
        return lambda k: self.cost.time(b * (k + 1)) / t_b

    def _observe_plain(self, batch: int, seconds: float) -> None:
        prev = self.plain_s.get(batch)
        self.plain_s[batch] = seconds if prev is None else 0.5 * prev + 0.5 * seconds
        fitted = self.cost.time(batch)
        if fitted:
            self.plain_ratio = 0.5 * self.plain_ratio + 0.5 * seconds / fitted

    def observe_step(self, tokens: int, seconds: float, emitted: int, batch: int, cold_s: float = 0.0,
                     lent: bool = False) -> None:
        """One decode step of ``batch`` requests: ``tokens`` through the forward, ``emitted`` delivered.

        ``cold_s``: the part of ``seconds`` spent waiting for drafts that no request could have had ready (an SSD
        re-probe after plain rounds, a drafter still on the prompt). It is left out of the cost fit and of the
        measured plain time, which describe steady speculation and plain decoding; the back-off's goodput keeps
        the whole step, since it judges what speculating really delivered. ``lent``: a plain step on both cores,
        measured apart (module docstring)."""
        if lent:
            recent = self.lent_samples.setdefault(batch, [])
            recent[:] = [*recent, seconds][-self.lend_probe_steps :]
            self.lent_s[batch] = statistics.median(recent)
            self.lent_at[batch_bucket(batch)] = self.steps
            return
        fit_s = max(seconds - cold_s, 1e-9)
        self.cost.observe(tokens, fit_s)
        if tokens <= batch:
            self._observe_plain(batch, fit_s)
        st = self.backoff(batch)
        if tokens <= batch or st.hold_left:  # a plain step, or one held plain (seeded requests keep their K)
            return
        st.window_steps += 1
        t_b = self.baseline(batch)
        warmup, window = self.window(batch)
        if st.window_steps <= warmup or t_b is None or seconds <= 0:
            return
        st.plain_equiv_s += emitted / batch * t_b
        st.spent_s += seconds
        measured = st.window_steps - warmup
        if measured % window == 0 or (measured == max(2, window // 3)
                                      and st.plain_equiv_s < self.early_loss * st.spent_s):
            self._judge(st, batch)

    def window(self, b: int) -> tuple[int, int]:
        """(warm-up steps, steps per window) at ``b`` requests a step: ``warmup`` and ``probe_window`` count
        request-rounds, so a step of b requests measures b of them (at least 2 and 6 steps). At batch 1 a window's
        goodput swings with each round's luck (tokens 1..K+1 at a hit rate near 0.2): a dozen steps read below 1x
        now and then where speculation pays 1.7x, and the drafter's catch-up on a new request or after a hold
        takes about 6 steps. At 16 a step averages 16 requests, and 6 steps suffice."""
        return max(2, self.warmup // b), max(6, self.probe_window // b)

    def _judge(self, st: Backoff, batch: int) -> None:
        """The end of a window: its goodput holds the batch plain (doubling the hold) or halves the next hold."""
        st.gain, st.plain_equiv_s, st.spent_s = st.plain_equiv_s / st.spent_s, 0.0, 0.0
        st.probing = False
        if st.gain < self.min_gain:
            grow = 4 if st.gain < self.clear_loss else 2
            st.hold_left = st.next_hold = min(max(self.hold, grow * st.next_hold), self.max_hold)
            self.backoffs += 1
            logger.info("speculation measured at %.2fx plain decoding at batch %d: plain for %d steps", st.gain, batch,
                        st.hold_left)
        else:
            # Each window of steps that paid halves the next hold, down to none: one window's goodput is noisy, so
            # where speculation hovers near break-even a lucky window must not undo what the failed ones measured.
            st.next_hold = st.next_hold // 2 if st.next_hold > self.hold else 0
            if self.lend_after is not None and self._lend_probe_due(batch):
                self._start_lend_probe(st, batch)

    def _start_lend_probe(self, st: Backoff, batch: int) -> None:
        """Hold steps of ``batch`` requests plain for ``lend_after`` + ``lend_probe_steps`` steps, the last ones
        lent: is plain decoding on both cores faster?"""
        st.hold_left = self.lend_after + self.lend_probe_steps
        self.lent_at[batch_bucket(batch)] = self.steps
        self.lend_probes += 1

    def _lend_probe_due(self, batch: int) -> bool:
        """Whether steps of ``batch`` requests should measure plain decoding on both cores again (module docstring):
        never measured, or not for ``lend_probe_every`` steps, or measured no faster than one core and not for the
        current wait (which doubles from ``lend_probe_soon`` each time that repeats)."""
        bucket = batch_bucket(batch)
        last = self.lent_at.get(bucket)
        if last is None:
            return True
        lent, plain = self.lent_s.get(batch), self.plain_time(batch)
        if lent is not None and plain is not None and lent >= plain:
            wait = self.lend_wait.get(bucket, self.lend_probe_soon)
            if self.steps - last > wait:
                self.lend_wait[bucket] = min(2 * wait, self.lend_probe_every)
                return True
            return False
        return self.steps - last > self.lend_probe_every

    def plan(self, accept: dict[str, tuple[int, int, int]]) -> dict[str, int]:
        """``accept[rid] = (accepted, drafted, rounds)`` for the requests of this step → K per request."""
        b = max(1, len(accept))
        self.steps += 1
        self._observe_population(accept)
        st = self.backoff(b)
        if self.lend_after is not None and self.k_max and batch_bucket(b) not in self.lent_at and not st.hold_left:
            self._start_lend_probe(st, b)  # before any window: what plain decoding on both cores costs
        held = bool(st.hold_left and self.k_max)
        if held:  # the measured back-off holds the batch plain (or a lend probe)
            st.hold_left -= 1
            self.backoff_steps += 1
            self.batch_k = 0
            if not st.hold_left:  # speculate again, and measure it afresh
                st.window_steps, st.plain_equiv_s, st.spent_s, st.probing = 0, 0.0, 0.0, True
        v = self._v(b)
        # A plain step: T(b) measured, not extrapolated. With no cost data yet, the first steps are a plain one and
        # then K = 1 until the fit spans two step sizes: at batch 16 a cold K = k_max step cost 2.5-3x a plain one
        # (and waited for drafts the drafter had not begun), where the planner may end up not speculating at all.
        cold_plain = v is None and b not in self.plain_s
        probe = self.steps % self.probe_plain_every == 0
        if held or cold_plain or (self.batch_k and self.k_max and probe):
            self.plain_steps += 1
            self.plain_rounds += len(accept)
            return dict.fromkeys(accept, 0)
        if v is None:  # a plain step of this size is measured: one at K = 1 gives the fit its second size
            self.batch_k = min(1, self.k_max)
            return dict.fromkeys(accept, self.batch_k)
        rates = {rid: self.acceptance(a, d) for rid, (a, d, _) in accept.items()}
        mean_a = sum(rates.values()) / len(rates) if rates else self.prior()
        scale = self._lent_scale(b)  # the batch's alternative is plain decoding on both cores where that is faster
        self.batch_k = best_k(min(mean_a, 1.0), self.draft_cost, lambda k: v(k) * scale, self.k_max)
        floor = int(st.probing and self.k_max > 0)  # the guard re-measures after a hold: a share of the batch speculates
        self.batch_k = max(self.batch_k, floor)
        probers = set(sorted(rates, key=rates.get, reverse=True)[: math.ceil(self.probe_share * b)]) if floor else set()
        # Once the guard has measured speculation losing at this batch size (and no window has paid since), its
        # own windows re-measure it; per-request re-probes would only add speculating steps (at batch 16 the
        # requests re-probe in step with each other, a K = 1 step for a share of them every ``probe_every`` rounds).
        reprobe = not st.next_hold
        groups = max(1, min(b, round(1 / self.probe_share)))
        out = {}
        for i, (rid, a) in enumerate(rates.items()):
            f = floor if rid in probers else 0
            k = max(best_k(min(a, 1.0), self.draft_cost, v, self.batch_k), f) if self.batch_k else 0
            rounds = accept[rid][2]
            if (k == 0 and self.k_max and reprobe and rounds and rounds % self.probe_every == 0
                    and (rounds // self.probe_every + i) % groups == 0):
                k = 1  # re-probe: acceptance estimates need drafted tokens to move (a new request has the prior)
            out[rid] = k
            self.plain_rounds += int(k == 0)
        return out
