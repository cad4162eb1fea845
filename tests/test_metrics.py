"""Prometheus metrics (vLLM's names plus ``ssd_*``) and the periodic stats log, on in-process servers (toy pair).

Counters must count up as requests run, agree with ``GetStats`` and the per-request stats, carry ``model_name`` on
every sample, and (SSD) include what the verifier learns from the drafter over the link.
"""

from __future__ import annotations

import logging
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from drafter_service.server import DrafterServer, DrafterServerConfig
from protos import codec
from spec_core.config import ModelConfig, SamplingParams, SpeculationConfig, SSDConfig
from spec_core.model_paths import model_name
from verifier_service.client import SSDClient
from verifier_service.server import VerifierServer, VerifierServerConfig
from verifier_service.stats_log import StatsLogger, format_line

PROMPTS = ["def add(a, b):\n", "class Stack:\n    def push(self, x):\n        "]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


def scrape(text: str | bytes) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition, keyed by (sample name, sorted labels without model_name)."""
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def model_names(text: bytes) -> set[str | None]:
    """The model names of every sample but Prometheus' standard ``process_*`` ones (the process's memory and CPU,
    which name no model)."""
    return {s.labels.get("model_name") for fam in text_string_to_metric_families(text.decode()) for s in fam.samples
            if not fam.name.startswith("process_")}


@pytest.fixture(scope="module")
def sd_server(toy_pair):
    cfg = VerifierServerConfig(ModelConfig(toy_pair["target"]), ModelConfig(toy_pair["draft"]),
                               spec=SpeculationConfig(mode="sd", k=2, adaptive_k=False), metrics_port=0,
                               served_model_name="toy-sd", stats_log_interval_s=0.2)
    server = VerifierServer(cfg)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ssd_server(toy_pair):
    drafter = DrafterServer(DrafterServerConfig(ModelConfig(toy_pair["draft"]), SSDConfig(k=2)))
    drafter.start()
    # K fixed: the counters' agreement is the point, not the planner (which may go plain on a loaded machine)
    server = VerifierServer(VerifierServerConfig(ModelConfig(toy_pair["target"]),
                                                 spec=SpeculationConfig(k=2, adaptive_k=False),
                                                 stats_log_interval_s=None))
    server.start(drafter.address)
    yield server
    server.stop()
    drafter.stop()


COUNTERS_THAT_GROW = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                      "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                      "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                      "vllm:request_generation_tokens_sum", "ssd_verify_seconds_count",
                      "ssd_host_device_crossings_total"]


def test_sd_counters_increase_and_agree_with_stats(sd_server) -> None:
    server = sd_server
    scrapes, results = [scrape(server.metrics.exposition())], []
    with SSDClient(server.address) as client:
        for prompt in PROMPTS:
            results.append(client.complete(prompt, PARAMS))
            scrapes.append(scrape(server.metrics.exposition()))
        stats = codec.stats_from_pb(client.stats())
    first, mid, last = scrapes
    for name in COUNTERS_THAT_GROW:
        assert value(first, name) < value(mid, name) < value(last, name), name
    assert value(last, "vllm:request_success_total", finished_reason="length") == \
        value(first, "vllm:request_success_total", finished_reason="length") + 2
    for key, v in mid.items():  # nothing counts down
        if key[0].endswith(("_total", "_count", "_sum", "_bucket")):
            assert last.get(key, 0.0) >= v, key

    def grew(name: str) -> float:
        return value(last, name) - value(first, name)

    # The counters are the requests' own counts, and acceptance from them is GetStats' acceptance.
    assert grew("vllm:spec_decode_num_draft_tokens_total") == sum(r.stats.num_drafted for r in results)
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == sum(r.stats.num_accepted for r in results)
    assert grew("vllm:generation_tokens_total") == sum(len(r.token_ids) for r in results)
    assert grew("vllm:prompt_tokens_total") == sum(r.num_prompt_tokens for r in results)
    accepted = value(last, "vllm:spec_decode_num_accepted_tokens_total")
    drafted = value(last, "vllm:spec_decode_num_draft_tokens_total")
    assert accepted / drafted == pytest.approx(stats["acceptance_rate"], rel=1e-12)
    drafts = value(last, "vllm:spec_decode_num_drafts_total")
    assert drafts == stats["drafts"] and 0 < drafts <= stats["rounds"]
    assert drafts <= drafted <= 2 * drafts  # k = 2: one or two tokens per draft
    per_pos = [value(last, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(2)]
    assert sum(per_pos) == accepted and drafts >= per_pos[0] >= per_pos[1]
    assert value(last, "vllm:num_requests_running") == 0 and value(last, "vllm:num_requests_waiting") == 0


def test_every_sample_has_the_model_name(sd_server, ssd_server, toy_pair) -> None:
    with SSDClient(ssd_server.address) as client:
        client.complete(PROMPTS[0], SamplingParams(max_new_tokens=4))
    assert model_names(sd_server.metrics.exposition()) == {"toy-sd"}  # served_model_name
    assert model_names(ssd_server.metrics.exposition()) == {model_name(toy_pair["target"])}  # the target's name


def test_metrics_port_serves_the_same_registry(sd_server) -> None:
    with urllib.request.urlopen(f"http://{sd_server.metrics_address}/metrics", timeout=30) as r:
        samples = scrape(r.read())
    assert ("vllm:spec_decode_num_drafts_total", ()) in samples
    assert ("vllm:kv_cache_usage_perc", ()) in samples
    buckets = [float(dict(k[1])["le"]) for k in samples if k[0] == "vllm:e2e_request_latency_seconds_bucket"]
    assert 120.0 in buckets


def test_ssd_counters_from_the_proposer_and_the_link(ssd_server) -> None:
    server = ssd_server
    with SSDClient(server.address) as client:
        client.complete(PROMPTS[1], SamplingParams(max_new_tokens=40, ignore_eos=True))
        stats = codec.stats_from_pb(client.stats())
    s = scrape(server.metrics.exposition())
    hits = value(s, "ssd_cache_hits_total")
    misses = value(s, "ssd_cache_misses_total", kind="jit") + value(s, "ssd_cache_misses_total", kind="backup")
    assert hits > 0 and hits + misses == stats["ssd_rounds"]
    assert hits / (hits + misses) == pytest.approx(stats["cache_hit_rate"], rel=1e-12)
    assert value(s, "ssd_predrafted_bundles_total") > 0
    assert value(s, "ssd_predrafted_branches_total") >= value(s, "ssd_predrafted_bundles_total")
    assert value(s, "ssd_link_bytes_total", direction="sent") > 0
    assert value(s, "ssd_link_bytes_total", direction="received") > 0
    assert value(s, "ssd_drafter_connected") == 1.0
    accepted = value(s, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted / value(s, "vllm:spec_decode_num_draft_tokens_total") == pytest.approx(stats["acceptance_rate"])


def test_stats_log_line_is_emitted(sd_server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="verifier_service.stats_log")
    with SSDClient(sd_server.address) as client:
        client.complete(PROMPTS[0], PARAMS)
    deadline = time.monotonic() + 10
    lines: list[str] = []
    while time.monotonic() < deadline and not lines:
        time.sleep(0.1)
        lines = [r.getMessage() for r in caplog.records if r.name == "verifier_service.stats_log"]
    assert lines, "no stats line within 10 s (interval 0.2 s)"
    assert "Avg generation throughput" in lines[0] and "Running: " in lines[0]
    assert "Draft acceptance rate" in lines[0] and "KV cache usage" in lines[0]


def test_stats_logger_is_quiet_when_idle_and_rates_are_per_interval(caplog) -> None:
    snap = {"mode": "ssd", "prompt_tokens": 0, "tokens_emitted": 0, "draft_tokens": 0, "accepted_tokens": 0,
            "drafts": 0, "ssd_hits": 0, "ssd_rounds": 0, "running": 0, "queued": 0, "kv_usage": 0.0}
    log = StatsLogger(lambda: dict(snap), interval_s=60)
    caplog.set_level(logging.INFO, logger="verifier_service.stats_log")
    assert log.log_once() is None and not caplog.records  # nothing happened
    before = dict(snap)
    snap.update(prompt_tokens=10, tokens_emitted=30, draft_tokens=20, accepted_tokens=15, drafts=10, ssd_hits=3,
                ssd_rounds=4, running=2, kv_usage=0.25)
    line = format_line(snap, before, 2.0)
    assert line == ("Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 15.0 tokens/s, Running: 2 reqs, "
                    "Waiting: 0 reqs, KV cache usage: 25.0%, Draft acceptance rate: 75.0%, "
                    "Mean acceptance length: 2.50, SSD cache hit rate: 75.0%")
    assert log.log_once() is not None and len(caplog.records) == 1


def test_counters_never_step_back_and_cancelled_is_abort() -> None:
    """A reconnect can briefly report fewer link bytes: the counter holds its highest value. Cancelled requests count
    as vLLM's ``abort``."""
    from verifier_service.metrics import ServiceMetrics

    stats = {"mode": "ssd", "link_bytes_sent": 100, "link_bytes_received": 50}
    m = ServiceMetrics(lambda: dict(stats), model_name="m")
    assert value(scrape(m.exposition()), "ssd_link_bytes_total", direction="sent") == 100
    stats["link_bytes_sent"] = 7
    assert value(scrape(m.exposition()), "ssd_link_bytes_total", direction="sent") == 100
    m.observe_request([1.0, 1.0, 1.2], 0.9, "cancelled", 3, finished_at=1.3)
    s = scrape(m.exposition())
    assert value(s, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(s, "vllm:inter_token_latency_seconds_count") == 1  # one gap: the first two tokens came together
    assert value(s, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(0.4)
