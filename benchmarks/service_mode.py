"""Bench mode ``ssd-service``: SSD through the real service (Ray-placed drafter and verifier, gRPC between them
and to this client). Timing is what the client observes: each token is stamped when its delta arrives here.

It runs the local ``ssd`` row's settings (:meth:`benchmarks.bench.BenchSettings.service_config`), except that at
concurrency 1 it runs at a fixed K and at concurrency > 1 it is relaunched with adaptive K (what ``ssd serve`` runs
by default); ``c`` streaming clients keep ``c`` requests in flight."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from protos import codec
from spec_core.config import SamplingParams
from spec_core.metrics import DecodeStats, ratio
from spec_core.settings import ServiceConfig
from verifier_service.api import GenerationResult

logger = logging.getLogger(__name__)

#: Tokens of each untimed request after a relaunch (:meth:`ServiceMode._warm_up`).
WARMUP_TOKENS = 32


class ServiceMode:
    def __init__(self, config: ServiceConfig) -> None:
        """``config``: the pair and its settings (the target's dtype as every other bench row runs it)."""
        import ray

        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        self.config = config
        self.adaptive: bool | None = None
        self.deployment = self.client = None
        self.configure(adaptive=False)

    def configure(self, adaptive: bool) -> bool:
        """(Re)launch the pair with or without adaptive K (True); a no-op when it already runs that way (False)."""
        from cluster.launch import launch
        from verifier_service.client import SSDClient

        if self.adaptive == adaptive:
            return False
        if self.deployment is not None:
            self.client.close()
            self.deployment.shutdown(grace_s=5)
        self.deployment = launch(self.config.model_copy(update={"fixed_k": not adaptive}))
        self.client = SSDClient(self.deployment.address)
        self.adaptive = adaptive
        return True

    def _warm_up(self, prompts: list[str], concurrency: int) -> None:
        """A relaunched pair's first batch, untimed: its planner measures its step costs at this batch size, as the
        local engine's did in the runs before (WARMUP_TOKENS each)."""
        params = SamplingParams(max_new_tokens=WARMUP_TOKENS, ignore_eos=True)
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda p: self.client.complete(p, params), prompts))

    def _counters(self) -> dict:
        return codec.stats_from_pb(self.client.stats())

    @staticmethod
    def _delta(before: dict, after: dict) -> dict:
        """What the service did between two ``GetStats`` snapshots: rounds, hit rate, link bytes, verifier wait."""
        d = {k: after.get(k, 0) - before.get(k, 0)
             for k in ("ssd_rounds", "ssd_hits", "link_bytes_sent", "link_bytes_received", "verifier_wait_s")}
        rounds = d["ssd_rounds"]
        return {"rounds": rounds, "cache_hit_rate": d["ssd_hits"] / rounds if rounds else None,
                "link_bytes": d["link_bytes_sent"] + d["link_bytes_received"], "wait_s": d["verifier_wait_s"]}

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
        stats = DecodeStats(num_generated=len(tokens), num_rounds=s.num_rounds,
                            num_round_tokens=round(s.mean_tokens_per_round * s.num_rounds), num_drafted=s.num_drafted,
                            num_accepted=s.num_accepted, prefill_s=times[0] - t0 if times else 0.0,
                            decode_s=times[-1] - times[0] if len(times) > 1 else 0.0)
        d = self._delta(before, after)
        extra = {
            "cache_hit_rate": d["cache_hit_rate"],
            "verifier_idle_fraction": d["wait_s"] / stats.decode_s if stats.decode_s else None,
            "link_bytes_per_round": d["link_bytes"] / d["rounds"] if d["rounds"] else None,
        }
        result = GenerationResult("ssd-service", [], tokens, final.text, codec.finish_reason_name(final.finish_reason), stats,
                                  stats.prefill_s, times)
        return result, extra

    def run_concurrent(self, prompts: list[str], params: list[SamplingParams], concurrency: int) -> dict:
        """Every prompt through the service with ``concurrency`` streaming clients; the same result keys as
        :func:`benchmarks.concurrent.run_concurrent` (aggregate tokens/s over the wall time of the whole set)."""
        if self.configure(adaptive=True):
            self._warm_up(prompts[:concurrency], concurrency)
        n = len(prompts)
        outputs: list[list[int]] = [[] for _ in range(n)]
        times: list[list[float]] = [[] for _ in range(n)]
        finals: list[object] = [None] * n

        def one(i: int) -> None:  # one channel, ``concurrency`` HTTP/2 streams in flight on it
            for resp in self.client.generate(prompts[i], params[i]):
                if resp.WhichOneof("kind") == "delta":
                    outputs[i].extend(resp.delta.token_ids)
                    times[i].extend([time.perf_counter()] * len(resp.delta.token_ids))
                else:
                    finals[i] = resp.final

        before = self._counters()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(n)))
        wall = time.perf_counter() - t0
        after = self._counters()
        rounds = sum(f.stats.num_rounds for f in finals)
        round_tokens = sum(round(f.stats.mean_tokens_per_round * f.stats.num_rounds) for f in finals)
        drafted, accepted = sum(f.stats.num_drafted for f in finals), sum(f.stats.num_accepted for f in finals)
        return {
            "tokens_per_s": sum(map(len, outputs)) / wall,
            "ttfts": [t[0] - t0 for t in times if t],
            "itls": [b - a for t in times for a, b in zip(t, t[1:])],
            "outputs": outputs,
            "mean_tokens_per_round": ratio(round_tokens, rounds),
            "acceptance_rate": ratio(accepted, drafted),
            "num_generated": sum(map(len, outputs)),
            "cache_hit_rate": self._delta(before, after)["cache_hit_rate"],
            "mean_batch_k": None,
        }

    def close(self) -> None:
        import ray

        self.client.close()
        self.deployment.shutdown(grace_s=5)
        if self._own_ray:
            ray.shutdown()
