"""The ``ssd-service`` bench mode: one request at a fixed K, then concurrent streaming clients with adaptive K,
through real Ray actors and gRPC; outputs equal the target's greedy output."""

from __future__ import annotations

from benchmarks.service_mode import ServiceMode
from spec_core.config import SamplingParams
from spec_core.settings import ServiceConfig

PROMPTS = ["def add(a, b):\n", "import os\n", "class Node:\n"]


def test_service_mode_single_and_concurrent(ray_session, toy_pair, greedy_reference) -> None:
    mode = ServiceMode(ServiceConfig(target=toy_pair["target"], draft=toy_pair["draft"], k=2, port=0))
    try:
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        result, extra = mode.run(PROMPTS[0], params)
        assert result.token_ids == greedy_reference(PROMPTS[0], 16)
        assert extra["cache_hit_rate"] is not None and extra["link_bytes_per_round"] > 0
        assert mode.adaptive is False

        out = mode.run_concurrent(PROMPTS, [params] * len(PROMPTS), concurrency=2)
        assert mode.adaptive is True  # relaunched with adaptive K for concurrency > 1
        assert out["outputs"] == [greedy_reference(p, 16) for p in PROMPTS]
        assert out["num_generated"] == 48 and out["tokens_per_s"] > 0
        assert len(out["ttfts"]) == 3 and len(out["itls"]) == 45
        assert out["mean_tokens_per_round"] >= 1.0
    finally:
        mode.close()
