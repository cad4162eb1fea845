"""Prometheus exposition for the verifier service (``ssd serve --metrics-port N``).

Gauges are read from the server's own counters at scrape time (one source of truth); latency histograms are
observed by the engine thread as requests finish (time to first token, inter-token latency) and per step
(verify forward, drafter proposal). Each server has its own registry, so several can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _StatsCollector:
    """Turns ``stats()`` (the dict GetStats returns) into gauges on every scrape."""

    GAUGES = {
        "ssd_acceptance_rate": ("acceptance_rate", "Accepted / drafted tokens, all requests"),
        "ssd_tokens_per_round": ("mean_tokens_per_round", "Mean tokens emitted per verification round"),
        "ssd_cache_hit_rate": ("cache_hit_rate", "Fraction of rounds whose speculation was pre-drafted in time"),
        "ssd_running_requests": ("running", "Requests in the running batch"),
        "ssd_queue_depth": ("queued", "Requests waiting to be scheduled"),
        "ssd_kv_block_usage": ("kv_usage", "Fraction of the target's KV blocks in use"),
        "ssd_drafter_connected": ("drafter_connected", "1 while the drafter stream is up"),
        "ssd_verifier_wait_fraction": ("verifier_wait_fraction", "Fraction of step time spent waiting for drafts"),
    }

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        for name, (key, doc) in self.GAUGES.items():
            value = s.get(key)
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value))
        by_pos = GaugeMetricFamily("ssd_acceptance_by_position", "Acceptance rate of draft position j",
                                   labels=["position"])
        for j, rate in enumerate(s.get("acceptance_by_position") or []):
            by_pos.add_metric([str(j + 1)], float(rate))
        yield by_pos


class ServiceMetrics:
    def __init__(self, stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats))
        r = self.registry
        self.ttft = Histogram("ssd_time_to_first_token_seconds", "Submit to first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("ssd_inter_token_latency_seconds", "Gap between consecutive emitted tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.verify = Histogram("ssd_verify_seconds", "Target forward (verification) time per step",
                                buckets=_LATENCY_BUCKETS, registry=r)
        self.draft = Histogram("ssd_draft_seconds", "Time the verifier spent obtaining speculations per step",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.crossings = Counter("ssd_host_device_crossings", "Host<->device crossings of the verifier's own step "
                                 "work (uploads + downloads; the proposer's are its own)", registry=r)
        self.requests = Counter("ssd_requests", "Finished requests", ["finish_reason"], registry=r)
        self.tokens = Counter("ssd_generated_tokens", "Generated tokens", registry=r)
        self.server = None

    def observe_request(self, emit_times: list[float], submitted_at: float, finish_reason: str | None) -> None:
        if emit_times:
            self.ttft.observe(max(0.0, emit_times[0] - submitted_at))
        for a, b in zip(emit_times, emit_times[1:]):
            self.itl.observe(b - a)
        self.requests.labels(finish_reason or "unknown").inc()
        self.tokens.inc(len(emit_times))

    def observe_step(self, verify_s: float, draft_s: float, crossings: int = 0) -> None:
        self.verify.observe(verify_s)
        self.draft.observe(draft_s)
        self.crossings.inc(crossings)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the HTTP exposition endpoint (``/metrics``); returns the bound port."""
        self.server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self.server.server_port

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
