"""The verifier engine is built in one place (:mod:`verifier_service.engine_builder`): what a plan composes, and that
no module outside the tests constructs an engine itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from verifier_service.engine_builder import EnginePlan, blocks_for_one, build_engine, plan_for_one

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spec_core", "drafter_service", "verifier_service", "cluster", "benchmarks", "ssd_cli")


def test_no_module_outside_the_builder_constructs_an_engine():
    offenders = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name == "engine_builder.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "VerifierEngine":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_a_plan_is_checked():
    with pytest.raises(ValueError, match="at least 1"):
        EnginePlan(0)
    with pytest.raises(ValueError, match="sampling"):
        EnginePlan(8, sampling="greedy")
    assert EnginePlan(8, k=3).scheduler().max_spec_nodes == 3
    assert EnginePlan(8, k=0).scheduler().max_spec_nodes == 1
    assert EnginePlan(8, k=3, max_spec_nodes=7, max_num_seqs=4).scheduler().max_num_seqs == 4


class _Proposer:
    max_nodes = 5

    def __call__(self, seqs, ks):
        raise AssertionError("not called here")


def test_features_are_composed_at_construction(toy_pair_runners):
    from verifier_service.adaptive import AdaptiveK
    from verifier_service.run_ahead_proposer import RunAheadProposer

    target = toy_pair_runners
    ar = build_engine(target, EnginePlan(8, k=3, adaptive_k=True))
    assert ar.k == 0 and ar.adaptive is None and ar.lending is None  # no proposer: plain decoding
    spec = build_engine(target, EnginePlan(8, k=3, adaptive_k=True, sampling="coupled"), _Proposer(), lending="L")
    assert spec.k == 3 and isinstance(spec.adaptive, AdaptiveK) and spec.adaptive.k_max == 3 and spec.lending == "L"
    assert spec.config.sampling == "coupled" and spec.config.num_blocks == 8
    ahead = RunAheadProposer.__new__(RunAheadProposer)
    assert build_engine(target, EnginePlan(8, k=3, adaptive_k=True), ahead).adaptive is None  # K stays fixed
    one = plan_for_one(target, 4)
    assert one.num_blocks == blocks_for_one(target, 4) and one.max_num_seqs == 1
    assert one.max_num_batched_tokens >= target.spec.max_positions + 5


@pytest.fixture(scope="module")
def toy_pair_runners(toy_pair):
    from spec_core.runner import ModelRunner

    return ModelRunner(toy_pair["target"])
