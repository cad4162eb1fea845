"""Prometheus metrics of the verifier service, named and meant as vLLM's (``vllm:*``), plus SSD's own (``ssd_*``).

One endpoint per deployment: the verifier's registry also carries what it learns from the drafter over the link
(bundles and branches received, JIT drafts, link bytes, reconnects), so users scrape only the verifier
(``--metrics-port``, or ``/metrics`` on the HTTP port via :meth:`ServiceMetrics.exposition`).

Two kinds of source, both counting only up:
  * per-request and per-step observations, made by the engine thread as requests get their first token or finish
    and after every step (``observe_*``): real prometheus ``Counter``/``Histogram`` objects;
  * lifetime totals the engine already keeps (rounds, drafted/accepted tokens, SSD hits and misses, bytes), read
    from ``stats()`` at scrape time by :class:`_TotalsCollector` as counters. One source of truth: acceptance from
    the counters (``accepted_tokens_total / draft_tokens_total``) is ``stats()["acceptance_rate"]``.

Every sample carries ``model_name`` (the served model name). Each server has its own registry, so several can live
in one process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: Seconds: sub-millisecond steps up to two-minute requests.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                   120.0)
#: vLLM's ``finished_reason`` values (``stop``, ``length``, ``abort``) for ours.
_FINISHED = {"cancelled": "abort"}


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# (metric name, stats() key, help) — lifetime totals exported as counters.
_SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "drafts", "Number of spec decoding drafts (rounds that proposed >= 1 token)."),
    ("vllm:spec_decode_num_draft_tokens", "draft_tokens", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens", "accepted_tokens", "Number of accepted tokens."),
)
_SSD_COUNTERS = (
    ("ssd_cache_hits", "ssd_hits", "Rounds whose speculation was pre-drafted in time (an SSD cache hit)."),
    ("ssd_predrafted_bundles", "bundles_received", "Branch bundles received from the drafter."),
    ("ssd_predrafted_branches", "branches_received", "Pre-drafted branches (speculations) received from the drafter."),
    ("ssd_jit_drafts", "jit_received", "Just-in-time speculations received from the drafter (after misses)."),
    ("ssd_drafter_reconnects", "drafter_reconnects", "Times the verifier re-established the drafter link."),
)
_GAUGES = (
    ("vllm:num_requests_running", "running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "queued", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "kv_usage", "KV-cache usage of the target. 1 means 100 percent usage."),
)


class _TotalsCollector:
    """``stats()`` on every scrape, as vLLM/SSD counters and gauges.

    Invariant: every counter it reports is non-decreasing between scrapes. The sources are lifetime totals that are
    never reset; the one that could briefly step back (link bytes while a reconnect swaps links) is held at its
    highest value so far.
    """

    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name
        self._high: dict[tuple[str, tuple[str, ...]], float] = {}
        self._lock = threading.Lock()

    def _monotone(self, name: str, labels: tuple[str, ...], value) -> float:
        key = (name, labels)
        v = max(float(value or 0), self._high.get(key, 0.0))
        self._high[key] = v
        return v

    def _counter(self, name: str, doc: str, rows: list[tuple[tuple[str, ...], object]],
                 extra: tuple[str, ...] = ()) -> CounterMetricFamily:
        fam = CounterMetricFamily(name, doc, labels=["model_name", *extra])
        for labels, value in rows:
            fam.add_metric([self.model_name, *labels], self._monotone(name, labels, value))
        return fam

    def _gauge(self, name: str, doc: str, value) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(name, doc, labels=["model_name"])
        fam.add_metric([self.model_name], float(value or 0))
        return fam

    def collect(self):
        s = self.stats()
        with self._lock:
            yield from self._common(s)
            if s.get("mode") in ("sd", "ssd"):
                yield from self._spec(s)
            if s.get("mode") == "ssd":
                yield from self._ssd(s)

    def _common(self, s: dict):
        for name, key, doc in _GAUGES:
            yield self._gauge(name, doc, s.get(key))
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            [((), s.get("tokens_emitted"))])
        yield self._counter("ssd_engine_failures", "Engine steps that failed (their batch failed; serving went on).",
                            [((), s.get("engine_failures"))])

    def _spec(self, s: dict):
        for name, key, doc in _SPEC_COUNTERS:
            yield self._counter(name, doc, [((), s.get(key))])
        per_pos = [((str(j),), n) for j, n in enumerate(s.get("accepted_tokens_per_pos") or [])]
        yield self._counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                            "Accepted tokens per draft position (0-based).", per_pos, ("position",))

    def _ssd(self, s: dict):
        for name, key, doc in _SSD_COUNTERS:
            yield self._counter(name, doc, [((), s.get(key))])
        yield self._counter("ssd_cache_misses", "Rounds that missed the SSD cache, by what served them: a "
                            "just-in-time (or late) draft, or the backup.",
                            [(("jit",), s.get("ssd_jit_misses")), (("backup",), s.get("ssd_backup_misses"))],
                            ("kind",))
        yield self._counter("ssd_link_bytes", "Bytes on the drafter link (protobuf payloads), lifetime.",
                            [(("sent",), s.get("link_bytes_sent")), (("received",), s.get("link_bytes_received"))],
                            ("direction",))
        yield self._gauge("ssd_drafter_connected", "1 while the drafter stream is up.", s.get("drafter_connected"))


class ServiceMetrics:
    """The verifier's registry: observations from the engine thread, totals from ``stats()`` at scrape time."""

    def __init__(self, stats: Callable[[], dict], model_name: str = "default", max_model_len: int = 131072) -> None:
        """``model_name``: the ``model_name`` label of every sample (the server passes its served model name, by
        default the target folder's name). ``max_model_len`` bounds the token-count histogram buckets."""
        self.stats = stats
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_TotalsCollector(stats, model_name))
        ProcessCollector(registry=self.registry)  # the verifier process's own memory and CPU (process_*)
        #: Prompt tokens of requests that got their first token (plain int: the stats log reads it).
        self.prompt_tokens = 0
        self._build(token_buckets(max_model_len))
        self.server = None
        self.stats_log = None

    def _build(self, tokens: tuple[int, ...]) -> None:
        r, lab, name = self.registry, ["model_name"], self.model_name

        def hist(metric: str, doc: str, buckets=LATENCY_BUCKETS):
            return Histogram(metric, doc, lab, buckets=buckets, registry=r).labels(name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds (one "
                        "sample per step that gave a request tokens: a round's tokens arrive together).")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.")
        self.req_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.req_gen = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.verify = hist("ssd_verify_seconds", "Target forward (verification) time per engine step.")
        self.draft = hist("ssd_draft_seconds", "Time the verifier spent obtaining speculations per engine step.")
        self.prompt_counter = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lab,
                                      registry=r).labels(name)
        self.crossings = Counter("ssd_host_device_crossings", "Host<->device crossings of the verifier's own step "
                                 "work (uploads + downloads; the proposer's are its own)", lab, registry=r).labels(name)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*lab, "finished_reason"], registry=r)

    # ---- observations (the engine thread) --------------------------------------------------------------------
    def observe_first_token(self, num_prompt_tokens: int, ttft_s: float) -> None:
        """A request's first token was published: its prompt counts as processed (as vLLM counts it)."""
        self.prompt_tokens += num_prompt_tokens
        self.prompt_counter.inc(num_prompt_tokens)
        self.ttft.observe(max(0.0, ttft_s))

    def observe_request(self, emit_times: list[float], submitted_at: float, finish_reason: str | None,
                        num_prompt_tokens: int = 0, finished_at: float | None = None) -> None:
        """A request finished (or was cancelled): its latencies, sizes and finish reason."""
        for a, b in zip(emit_times, emit_times[1:]):
            if b > a:
                self.itl.observe(b - a)
        end = finished_at if finished_at is not None else time.perf_counter()
        self.e2e.observe(max(0.0, end - submitted_at))
        self.req_prompt.observe(num_prompt_tokens)
        self.req_gen.observe(len(emit_times))
        reason = finish_reason or "unknown"
        self.success.labels(self.model_name, _FINISHED.get(reason, reason)).inc()

    def observe_step(self, verify_s: float, draft_s: float, crossings: int = 0) -> None:
        self.verify.observe(verify_s)
        self.draft.observe(draft_s)
        self.crossings.inc(crossings)

    # ---- reading -------------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """``stats()`` plus the counts only the metrics keep (``prompt_tokens``): what the stats log differences."""
        return {**self.stats(), "prompt_tokens": self.prompt_tokens}

    def exposition(self) -> bytes:
        """The Prometheus text exposition of this registry (what ``/metrics`` serves)."""
        return generate_latest(self.registry)

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the HTTP exposition endpoint (``/metrics``); returns the bound port."""
        self.server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self.server.server_port

    def start_stats_log(self, interval_s: float) -> None:
        """The periodic one-line stats log (:class:`verifier_service.stats_log.StatsLogger`), until :meth:`stop`."""
        from verifier_service.stats_log import StatsLogger

        self.stats_log = StatsLogger(self.snapshot, interval_s)
        self.stats_log.start()

    def stop(self) -> None:
        if self.stats_log is not None:
            self.stats_log.stop()
        if self.server is not None:
            self.server.shutdown()
