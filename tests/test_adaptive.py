"""Adaptive K (down to 0) and its measured back-off, as units (in the SSD loop: ``test_adaptive_loop.py``)."""

from __future__ import annotations

import pytest

from verifier_service.adaptive import AdaptiveK, LinearCost


class FixedCost(LinearCost):
    """T(n) = t0 + t1·n, ignoring observations (a test's injected cost model)."""

    def __init__(self, t0: float, t1: float) -> None:
        super().__init__()
        self.t0, self.t1 = t0, t1

    def observe(self, n: int, seconds: float) -> None:
        pass

    def coefficients(self):
        return self.t0, self.t1


def test_linear_cost_recovers_the_fit() -> None:
    cost = LinearCost()
    for n in (1, 3, 5, 9, 17, 2, 6, 40):
        cost.observe(n, 0.004 + 0.0005 * n)
    t0, t1 = cost.coefficients()
    assert t0 == pytest.approx(0.004, rel=1e-6) and t1 == pytest.approx(0.0005, rel=1e-6)
    assert LinearCost().coefficients() is None


def test_k_falls_to_zero_when_speculation_does_not_pay() -> None:
    cheap = AdaptiveK(k_max=5, cost=FixedCost(0.01, 0.0001))
    plan = cheap.plan({"a": (90, 100, 20)})
    assert plan == {"a": 5} and cheap.batch_k == 5
    # expensive verification (large batch on a compute-bound target) and low acceptance: plain decoding
    costly = AdaptiveK(k_max=5, cost=FixedCost(0.001, 0.01))
    plan = costly.plan({f"r{i}": (10, 100, 7) for i in range(16)})
    assert costly.batch_k == 0 and set(plan.values()) == {0}
    # per request: a predictable request keeps speculating, a hopeless one falls to 0 (then re-probes)
    mid = AdaptiveK(k_max=5, cost=FixedCost(0.01, 0.002))
    plan = mid.plan({"easy": (95, 100, 21), "hard": (2, 100, 21)})
    assert plan["easy"] > 0 and plan["hard"] == 0
    # re-probes rotate over the batch (``probe_share``): with two requests, each has every other re-probe round
    assert mid.plan({"easy": (95, 100, 21), "hard": (2, 100, 32)})["hard"] == 0
    assert mid.plan({"easy": (95, 100, 21), "hard": (2, 100, 48)})["hard"] == 1
    assert AdaptiveK(k_max=5, cost=FixedCost(0.01, 0.002)).plan({"hard": (2, 100, 32)}) == {"hard": 1}  # alone


def _run_steps(planner: AdaptiveK, steps: int, b: int, spec_s: float, plain_s: float, emitted: int) -> list[int]:
    """Drive the planner through ``steps`` decode steps of ``b`` requests: a step that speculates (K > 0 for any
    request) takes ``spec_s`` and emits ``emitted`` tokens, a plain one ``plain_s`` and ``b``. Returns batch K."""
    ks = []
    for _ in range(steps):
        plan = planner.plan({f"r{i}": (50, 100, 40) for i in range(b)})
        k = sum(plan.values())
        planner.observe_step(b + k, spec_s if k else plain_s, emitted if k else b, b)
        ks.append(planner.batch_k if k else 0)
    return ks


def test_measured_backoff_stops_speculation_that_loses() -> None:
    # The model is told speculation is nearly free (flat cost, a flattering prior), but each speculating step
    # measures 1.4x a plain one's time for 1.2x its tokens: the guard backs the batch off to plain decoding.
    planner = AdaptiveK(k_max=3, cost=FixedCost(0.1, 0.0001))
    ks = _run_steps(planner, 400, b=16, spec_s=0.14, plain_s=0.1, emitted=19)
    assert planner.backoffs >= 3 and planner.backoff_steps > 300
    probe = sum(planner.window(16))  # speculating steps before each judgement
    assert planner.window(16) == (2, 6) and planner.window(1) == (planner.warmup, planner.probe_window)
    assert sum(k > 0 for k in ks) <= (planner.backoffs + 1) * probe  # probing windows only, and the holds grow
    assert planner.backoff(16).next_hold > planner.hold
    # The same model where speculation really pays (2x the tokens for 1.3x the time) never backs off.
    paying = AdaptiveK(k_max=3, cost=FixedCost(0.1, 0.0001))
    ks = _run_steps(paying, 200, b=16, spec_s=0.13, plain_s=0.1, emitted=32)
    assert paying.backoffs == 0 and sum(k > 0 for k in ks) > 180


def test_measured_backoff_returns_when_speculation_pays_again() -> None:
    planner = AdaptiveK(k_max=3, cost=FixedCost(0.1, 0.0001))
    _run_until(planner, lambda: planner.backoffs == 1, b=16, spec_s=0.14, plain_s=0.1, emitted=17)
    assert planner.backoff(16).hold_left > 0
    ks = _run_steps(planner, planner.backoff(16).hold_left + 40, b=16, spec_s=0.12, plain_s=0.1, emitted=30)
    assert planner.backoffs == 1 and sum(k > 0 for k in ks[-30:]) >= 27 and planner.backoff(16).next_hold == 0


def _run_until(planner: AdaptiveK, done, limit: int = 1000, **step) -> None:
    """Drive the planner one step at a time (as :func:`_run_steps`) until ``done()``."""
    for _ in range(limit):
        if done():
            return
        _run_steps(planner, 1, **step)
    raise AssertionError("the planner never got there")


def test_a_lucky_window_halves_the_hold_instead_of_undoing_it() -> None:
    """Speculation near break-even: windows fail, then one pays by a hair (noise). The next hold is half the last,
    not the shortest again, so such a batch spends most of its steps plain; sustained paying windows still bring
    the hold down to none."""
    planner = AdaptiveK(k_max=3, cost=FixedCost(0.1, 0.0001))
    st = planner.backoff(16)
    lose = dict(b=16, spec_s=0.112, plain_s=0.1, emitted=17)  # 0.95x: near break-even, the hold doubles
    win = dict(b=16, spec_s=0.1, plain_s=0.1, emitted=17)
    _run_until(planner, lambda: planner.backoffs == 3, **lose)  # holds of 48, 96 and 192 steps
    assert st.next_hold == 4 * planner.hold
    _run_until(planner, lambda: st.probing, **win)  # the hold ends; the window after it pays
    _run_until(planner, lambda: not st.probing, **win)
    assert planner.backoffs == 3 and st.next_hold == 2 * planner.hold
    _run_until(planner, lambda: planner.backoffs == 4, **lose)  # it fails again
    assert st.hold_left == 4 * planner.hold  # not back to the shortest hold
    _run_until(planner, lambda: st.probing, **win)  # then it pays for good: each window of steps halves the hold
    _run_until(planner, lambda: not st.probing, **win)
    assert st.next_hold == 2 * planner.hold
    _run_steps(planner, 3 * planner.probe_window, **win)
    assert st.next_hold == 0 and planner.backoffs == 4


def test_a_clear_loss_is_cut_short_and_held_longer() -> None:
    """At 0.7x (batch 1) the window is judged after the first third of its steps and each hold grows 4x; at 0.95x
    the window runs whole and the hold doubles; a window that pays by 1.5x is never cut short."""
    clear = AdaptiveK(k_max=3, cost=FixedCost(0.01, 0.0001))
    warmup, window = clear.window(1)
    ks = _run_steps(clear, 400, b=1, spec_s=0.0143, plain_s=0.01, emitted=1)
    assert clear.backoffs >= 2
    assert clear.backoff(1).next_hold == min(4 ** (clear.backoffs - 1) * clear.hold, clear.max_hold)
    first = ks.index(0, 1)  # the steps before the first hold: a plain cold step, a K = 1 step, then the window
    assert sum(k > 0 for k in ks[:first]) <= 1 + warmup + window // 3
    near = AdaptiveK(k_max=3, cost=FixedCost(0.01, 0.0001))
    ks = _run_steps(near, 400, b=1, spec_s=0.0105, plain_s=0.01, emitted=1)
    assert near.backoffs >= 2
    assert near.backoff(1).next_hold == min(2 ** (near.backoffs - 1) * near.hold, near.max_hold)
    assert sum(k > 0 for k in ks[:ks.index(0, 1)]) >= warmup + window
    paying = AdaptiveK(k_max=3, cost=FixedCost(0.01, 0.0001))
    _run_steps(paying, 400, b=1, spec_s=0.0133, plain_s=0.01, emitted=2)
    assert paying.backoffs == 0


def test_the_window_after_a_hold_speculates_even_where_estimates_say_plain() -> None:
    """After a cold start the guard holds the batch plain, and the cold rounds' misses have dragged the measured
    acceptance below break-even, so the model alone would plan K = 0 for good (the guard stops per-request
    re-probes once it has measured a loss). The window after the hold still speculates, measures that speculation
    now pays, and speculation resumes."""
    planner = AdaptiveK(k_max=3, cost=FixedCost(0.03, 0.009))  # V(1) = 1.23: pays above an acceptance of ~0.23
    planner.observe_step(1, 0.036, 1, 1)  # a plain step measured
    st = planner.backoff(1)
    st.hold_left = st.next_hold = planner.hold  # as after the cold start's failed windows
    accepted, drafted = 0, 40  # the cold rounds: nothing accepted
    assert planner.acceptance(accepted, drafted) < 0.2
    ks = []
    for step in range(40, 240):
        k = planner.plan({"r": (accepted, drafted, step)})["r"]
        drafted += k
        accepted += round(k * 0.9)
        planner.observe_step(1 + k, 0.045 if k else 0.036, 1 + round(0.9 * k) if k else 1, 1)
        ks.append(k)
    assert ks[:planner.hold] == [0] * planner.hold and planner.backoffs == 0
    window = ks[planner.hold:planner.hold + sum(planner.window(1))]
    assert sum(k > 0 for k in window) >= len(window) - 2, window  # all but the periodic plain steps
    assert planner.acceptance(accepted, drafted) > 0.6  # re-measured: the estimate followed the drafted tokens
    assert sum(k > 0 for k in ks[-60:]) >= 50 and planner.backoff(1).next_hold == 0


def test_backoff_is_kept_per_batch_size_range() -> None:
    """A hold learned at 16 in flight does not stop a lone request from speculating, and the hold at 16 stays."""
    from verifier_service.adaptive import batch_bucket

    assert [batch_bucket(b) for b in (1, 2, 3, 4, 7, 8, 15, 16, 31)] == [1, 2, 2, 3, 3, 4, 4, 5, 5]
    planner = AdaptiveK(k_max=3, cost=FixedCost(0.1, 0.0001))
    _run_until(planner, lambda: planner.backoffs == 1, b=16, spec_s=0.14, plain_s=0.1, emitted=17)  # loses at 16
    held = planner.backoff(16).hold_left
    assert planner.backoffs == 1 and held > 0 and planner.backoff(1).hold_left == 0
    ks = _run_steps(planner, 30, b=1, spec_s=0.02, plain_s=0.015, emitted=3)  # pays at 1: 3 tokens for 1.33x
    assert planner.backoffs == 1 and sum(k > 0 for k in ks) >= 25
    assert planner.backoff(16).hold_left == held  # batch-1 steps do not spend the hold at 16
    assert _run_steps(planner, 5, b=16, spec_s=0.14, plain_s=0.1, emitted=17) == [0] * 5


def test_no_per_request_reprobes_where_the_guard_measured_a_loss() -> None:
    """Per-request re-probes (K = 1 every ``probe_every`` rounds for a request planned at 0, a quarter of the batch
    at a time) stop at a batch size where the back-off has measured speculation losing; the guard's own windows
    re-measure it there."""
    planner = AdaptiveK(k_max=5, cost=FixedCost(0.001, 0.01))  # speculation does not pay: batch K = 0
    hard = {f"r{i}": (10, 100, 32) for i in range(16)}  # round 32: a re-probe round
    assert sum(planner.plan(hard).values()) == 4
    planner.backoff(16).next_hold = planner.hold  # as after a failed window at 16 in flight
    assert set(planner.plan(hard).values()) == {0}
    assert planner.plan({"r0": (10, 100, 32)}) == {"r0": 1}  # batch 1 has measured nothing: it still re-probes


def test_probes_speculate_on_a_share_of_the_batch() -> None:
    """At 16 in flight, each re-probe round re-probes 4 requests, every request once in 4 such rounds; the window
    after a hold floors the 4 requests with the highest estimated acceptance at K = 1, not all 16. Where
    speculation loses at the margin, the requests' speculated rounds before the guard backs off for good are a
    quarter of what whole-batch probes spend, and the back-off still holds."""
    planner = AdaptiveK(k_max=3, cost=FixedCost(0.001, 0.01))
    probed = {f"r{i}": 0 for i in range(16)}
    for rounds in (32, 48, 64, 80):
        plan = planner.plan({rid: (10, 100, rounds) for rid in probed})
        assert sum(plan.values()) == 4
        for rid, k in plan.items():
            probed[rid] += k
    assert set(probed.values()) == {1}
    st = planner.backoff(16)
    st.probing = True  # the window after a hold
    plan = planner.plan({f"r{i}": (i, 100, 7) for i in range(16)})  # r12..r15 have the highest acceptance
    assert {rid for rid, k in plan.items() if k} == {"r12", "r13", "r14", "r15"}
    planner.backoff(1).probing = True
    assert planner.plan({"r0": (0, 100, 7)}) == {"r0": 1}  # alone, the request is the whole batch

    def spend(share: float) -> tuple[int, int]:
        """Request-rounds speculated over 600 steps where each speculated token costs 3% of a plain step and
        earns 0.2 tokens (a loss at the margin: a token is worth 1/16 of a step), and the back-offs."""
        p = AdaptiveK(k_max=3, cost=FixedCost(0.001, 0.01), probe_share=share)  # the model plans K = 0 here
        spent = 0
        for step in range(600):
            plan = p.plan({f"r{i}": (10, 100, 40 + step) for i in range(16)})
            extra = sum(plan.values())
            spent += sum(k > 0 for k in plan.values())
            p.observe_step(16 + extra, 0.1 * (1 + 0.03 * extra), 16 + round(0.2 * extra), 16)
        return spent, p.backoffs

    whole, share = spend(1.0), spend(0.25)
    assert whole[1] >= 2 and share[1] >= 2
    assert share[0] <= 0.4 * whole[0], (share, whole)


def _planner_after_workload(rate: float) -> AdaptiveK:
    """A planner that has served 16 requests for 40 steps at K = 2, their drafts accepted at ``rate``. Its cost
    model makes speculation pay at batch 16 above an acceptance of about 0.56 (V(1) = 1.56)."""
    planner = AdaptiveK(k_max=3, cost=FixedCost(0.05, 0.004))
    for step in range(1, 41):
        planner.plan({f"old{i}": (int(rate * 2 * step), 2 * step, step) for i in range(16)})
    return planner


def test_new_requests_start_from_the_workloads_acceptance() -> None:
    """The acceptance prior is the workload's (module docstring of :mod:`verifier_service.adaptive`): after requests
    whose drafts were rarely accepted, 16 new ones start plain, without a first-round probe; after requests whose
    drafts were accepted, they speculate from their first round."""
    fresh = {f"new{i}": (0, 0, 0) for i in range(16)}
    low = _planner_after_workload(0.3)
    assert low.prior() == pytest.approx(0.3, abs=0.02)
    assert set(low.plan(fresh).values()) == {0} and low.batch_k == 0
    high = _planner_after_workload(0.9)
    assert high.prior() == pytest.approx(0.9, abs=0.02)
    assert min(high.plan(fresh).values()) >= 1 and high.batch_k >= 1
    # A fixed prior of 0.7 (the planner before it served anything) would have speculated on the first workload.
    assert set(AdaptiveK(k_max=3, cost=FixedCost(0.05, 0.004)).plan(fresh).values()) != {0}
    # Steps that draft nothing (held plain) do not age the workload's acceptance back towards the fixed prior.
    for _ in range(1000):
        low.plan(fresh)
    assert low.prior() == pytest.approx(0.3, abs=0.02)


def _run_concave(planner: AdaptiveK, steps: int, emitted: int) -> int:
    """Batch 16 with the measured shape of a bf16 step: plain steps (16 tokens) take 0.11 s, speculating steps of
    any size (25-58 tokens) about 0.2 s. Returns the speculating steps."""
    import random

    rng, spec = random.Random(0), 0
    for _ in range(steps):
        plan = planner.plan({f"r{i}": (50, 100, 40) for i in range(16)})
        k = sum(plan.values())
        if k:
            spec += 1
            planner.observe_step(16 + rng.randint(min(k, 9), max(k, 42)), 0.2 + rng.uniform(-0.02, 0.02), emitted, 16)
        else:
            planner.observe_step(16, 0.11 + rng.uniform(-0.01, 0.01), 16, 16)
    return spec


def test_plain_steps_are_measured_not_fitted() -> None:
    # The line through these steps puts T(16) near 0.2 s, so speculation judged against it looks 1.5x as productive
    # as plain decoding; against the measured 0.11 s plain step it is 0.86x (25 tokens a step), and the batch stops.
    losing = AdaptiveK(k_max=3, cost=LinearCost())
    spec = _run_concave(losing, 300, emitted=25)
    assert losing.plain_time(16) == pytest.approx(0.11, abs=0.015)
    assert losing.backoffs >= 1 and spec < 75, (losing.backoffs, spec)
    # 40 tokens a step (1.4x plain decoding, measured) keeps speculating
    paying = AdaptiveK(k_max=3, cost=LinearCost())
    spec = _run_concave(paying, 300, emitted=40)
    assert paying.backoffs == 0 and spec > 180, (paying.backoffs, spec)  # (plain probes, and K = 0 where marginal)


def test_one_step_in_probe_plain_every_is_plain_and_refreshes_the_plain_time() -> None:
    """While speculation pays, the planner still runs one plain step in ``probe_plain_every`` (after its cold
    start), so the measured plain time follows the machine: here plain decoding slows from 18 to 24 ms halfway."""
    planner = AdaptiveK(k_max=3)
    plain = []
    for step in range(480):
        slow = step >= 240
        k = planner.plan({"r": (80, 100, step)})["r"]
        if k == 0:
            plain.append(step)
            planner.observe_step(1, 0.024 if slow else 0.018, 1, 1)
        else:
            planner.observe_step(1 + k, (0.027 if slow else 0.021) + 0.001 * k, 1 + 0.8 * k, 1)
    late = [s for s in plain if s >= 2]  # the cold start's plain step comes first
    assert len(late) == 480 // planner.probe_plain_every, plain
    assert all(b - a == planner.probe_plain_every for a, b in zip(late, late[1:])), plain
    assert planner.plain_time(1) == pytest.approx(0.024, rel=0.05)


def test_waits_no_hit_could_avoid_are_left_out_of_the_cost_fit() -> None:
    """An SSD step that re-probes after plain rounds (or whose drafter is still on the prompt) waits for drafts by
    construction. Those seconds (``cold_s``) stay out of the fit and the measured plain time, so the planner prices
    a drafted token at what steady speculation costs; the back-off's goodput keeps the whole step."""
    fitted, whole = AdaptiveK(k_max=3), AdaptiveK(k_max=3)
    for planner, honest in ((fitted, True), (whole, False)):
        for _ in range(16):
            planner.observe_step(1, 0.018, 1, 1)  # plain steps
            planner.observe_step(4, 0.021 + 0.017, 2, 1, cold_s=0.017 if honest else 0.0)  # K = 3, 17 ms waiting
    assert fitted.cost.time(4) / fitted.cost.time(1) == pytest.approx(0.021 / 0.018, rel=1e-3)
    assert whole.cost.time(4) / whole.cost.time(1) == pytest.approx(0.038 / 0.018, rel=1e-3)
    # at an acceptance of 0.5, V(3) = 1.17 pays best (1.875 tokens a step); with the waits fitted as a cost of
    # each drafted token, V(3) = 2.1 and only K = 1 pays (V(1) = 1.37 for 1.5 tokens)
    assert fitted.plan({"r": (50, 100, 40)}) == {"r": 3} and whole.plan({"r": (50, 100, 40)}) == {"r": 1}
    # an empty backup's step (one token through the forward) that waited: plain time without the wait
    fitted.observe_step(1, 0.030, 1, 1, cold_s=0.012)
    assert fitted.plain_s[1] == pytest.approx(0.018)
    planner = AdaptiveK(k_max=3)
    planner.observe_step(1, 0.018, 1, 1)
    warm, window = planner.window(1)
    for _ in range(warm + window):  # steps that each waited 30 ms for 1 token: the guard sees the whole step
        planner.observe_step(4, 0.048, 1, 1, cold_s=0.030)
    assert planner.backoff(1).gain == pytest.approx(0.018 / 0.048) and planner.backoffs == 1
