"""The drafter fits each batch of bundles to the verifier's step (``SSDConfig.fit_fanout``): the per-request fan-out
budget shrinks when its fitted build time would not fit, and never changes what is generated."""

from __future__ import annotations

import os

import pytest
from reference_decoding import generate_ar

from cluster.local_ssd import LocalSSD
from drafter_service.loopback import LoopbackLink
from drafter_service.ssd_drafter import SSDDrafter
from spec_core.config import SamplingParams, SSDConfig
from spec_core.fanout import FanoutConfig
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from spec_core.settings import ServiceConfig


@pytest.fixture(scope="module")
def drafter(tiny_models):
    return SSDDrafter(ModelRunner(tiny_models["llama-draft"]), SSDConfig(k=3, fanout=FanoutConfig(budget=12)))


def test_the_budget_shrinks_to_fit_the_verifiers_step(drafter):
    """Fitted build time 1 ms + 0.1 ms per unit (glue token, or branch per decode step), verify step 50 ms."""
    drafter.verify_s = None
    assert drafter._fitted_budget(50, 48) == 12  # no verify time heard yet: the full budget
    drafter.verify_s = 0.05
    drafter.build_cost.observe(100, 0.011)
    drafter.build_cost.observe(400, 0.041)
    drafter.build_cost.observe(250, 0.026)
    t0, t1 = drafter.build_cost.coefficients()
    assert t0 == pytest.approx(0.001) and t1 == pytest.approx(0.0001)
    assert drafter._fitted_budget(50, 3) == 12  # one request, K = 3: 12 branches fit easily
    assert drafter._fitted_budget(50, 48) == 9  # 16 requests: (50 - 1 - 5) ms / (0.1 ms x 48) = 9.2
    assert drafter._fitted_budget(50, 480) == 1  # never below one branch per request
    drafter.verify_s = 1.0
    assert drafter._fitted_budget(50, 48) == 12  # a slow verifier: the full budget, never more


def test_before_a_fit_the_seconds_per_unit_of_recent_builds_are_used(tiny_models):
    d = SSDDrafter(ModelRunner(tiny_models["llama-draft"]), SSDConfig(k=3, fanout=FanoutConfig(budget=12)))
    d.verify_s = 0.02
    d._observe_build(100, 0.05)  # 0.5 ms per unit, one size seen: no linear fit yet
    assert d.build_cost.coefficients() is None
    assert d._fitted_budget(0, 12) == 3  # 20 ms / (0.5 ms x 12)


def test_off_and_in_process_drafters_keep_the_full_budget(tiny_models):
    runner = ModelRunner(tiny_models["llama-draft"])
    off = SSDDrafter(runner, SSDConfig(k=3, fit_fanout=None))
    off.verify_s, off.build_s_per_unit = 0.001, 1.0
    assert off._fitted_budget(10, 48) == off.config.fanout.budget
    looped = SSDDrafter(runner, SSDConfig(k=3))
    LoopbackLink(looped)  # builds inside the verifier's step: nothing to fit
    assert looped.config.fit_fanout is None
    with pytest.raises(ValueError, match="fit_fanout"):
        SSDConfig(fit_fanout=0.0)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores and CPU affinity")
def test_a_fitted_drafter_process_sends_smaller_bundles_and_the_output_equals_ar(tiny_models):
    """End to end (two processes), 6 requests at once after a warm-up request (so the drafter has heard the
    verifier's step and timed its builds): a fit to 1% of that step cuts the bundles to about one branch per
    request; greedy output is still the target's own."""
    target = ModelRunner(tiny_models["llama"])
    prompts = [[1 + (7 * i + j) % 200 for j in range(12)] for i in range(6)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ref = []
    for p in prompts:
        seq = Sequence("ref", p, params)
        generate_ar(target, seq)
        ref.append(seq.output_ids)
    ratios = {}
    for fit in (0, 0.01):
        cfg = ServiceConfig(draft=str(tiny_models["llama-draft"]), k=3, budget=12, fit_fanout=fit, fixed_k=True,
                            max_num_seqs=6)
        with LocalSSD(target, cfg) as local:
            local.engine.add(Sequence("warm", prompts[0], params))
            local.engine.run()
            stats = local.proposer.stats
            bundles, branches = stats.bundles_received, stats.branches_received
            seqs = [Sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
            for s in seqs:
                local.engine.add(s)
            local.engine.run()
            bundles, branches = stats.bundles_received - bundles, stats.branches_received - branches
        assert [s.output_ids for s in seqs] == ref, fit
        assert bundles >= len(prompts), (fit, stats)  # at least each request's first (prefill) bundle
        ratios[fit] = branches / bundles
    print("branches per bundle", ratios)
    assert ratios[0] > 10 and ratios[0.01] < 6, ratios
