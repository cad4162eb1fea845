"""Bench mode ``ssd-service``: SSD through the real service (Ray-placed drafter and verifier, gRPC between them
and to this client). Timing is what the client observes: each token is stamped when its delta arrives here."""

from __future__ import annotations

import json
import logging
import time

from spec_core.api import GenerationResult
from spec_core.config import SamplingParams
from spec_core.decoding import DecodeStats

logger = logging.getLogger(__name__)


class ServiceMode:
    def __init__(self, target_path: str, draft_path: str, k: int) -> None:
        import ray

        from cluster.launch import PairConfig, launch
        from verifier_service.client import SSDClient

        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        # fixed K, like the local ssd mode it is compared with
        self.deployment = launch(PairConfig(target_path, draft_path, k=k, port=0, adaptive_k=False))
        self.client = SSDClient(self.deployment.address)

    def _counters(self) -> dict:
        return json.loads(self.client.stats().json)

    def run(self, prompt: str, params: SamplingParams) -> tuple[GenerationResult, dict]:
        before = self._counters()
        t0 = time.perf_counter()
        tokens: list[int] = []
        times: list[float] = []
        final = None
        for resp in self.client.generate(prompt, params):
            now = time.perf_counter()
            if resp.WhichOneof("kind") == "delta":
                tokens.extend(resp.delta.token_ids)
                times.extend([now] * len(resp.delta.token_ids))
            else:
                final = resp.final
        after = self._counters()
        s = final.stats
        stats = DecodeStats(num_generated=len(tokens), num_rounds=s.num_rounds, num_drafted=s.num_drafted,
                            num_accepted=s.num_accepted, prefill_s=times[0] - t0 if times else 0.0,
                            decode_s=times[-1] - times[0] if len(times) > 1 else 0.0)
        rounds = after.get("ssd_rounds", 0) - before.get("ssd_rounds", 0)
        link = sum(after.get(k, 0) - before.get(k, 0) for k in ("link_bytes_sent", "link_bytes_received"))
        wait = after.get("verifier_wait_s", 0.0) - before.get("verifier_wait_s", 0.0)
        extra = {
            "cache_hit_rate": (after["ssd_hits"] - before["ssd_hits"]) / rounds if rounds else None,
            "verifier_idle_fraction": wait / stats.decode_s if stats.decode_s else None,
            "link_bytes_per_round": link / rounds if rounds else None,
        }
        result = GenerationResult("ssd-service", [], tokens, final.text, final.finish_reason, stats,
                                  stats.prefill_s, times)
        return result, extra

    def close(self) -> None:
        import ray

        self.client.close()
        self.deployment.shutdown(grace_s=5)
        if self._own_ray:
            ray.shutdown()
