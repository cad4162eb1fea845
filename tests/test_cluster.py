"""Ray placement of the pair, and ``ssd serve`` end to end as a subprocess on a real TCP port."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from spec_core.config import SamplingParams
from verifier_service.client import SSDClient

PROMPTS = [f"def task_{i}(x):\n    " for i in range(8)]


def test_placement_one_gpu_each_in_one_group(ray_session, toy_pair, greedy_reference) -> None:
    from cluster.launch import launch
    from spec_core.settings import ServiceConfig

    dep = launch(ServiceConfig(target=toy_pair["target"], draft=toy_pair["draft"], port=0, gpu="yes",
                               dtype="float32"))
    try:
        info = dep.info()
        d, v = info["drafter"], info["verifier"]
        assert d["pid"] != v["pid"]
        assert d["placement_group_id"] == v["placement_group_id"] == dep.pg.id.hex()
        assert len(d["gpu_ids"]) == 1 and len(v["gpu_ids"]) == 1 and d["gpu_ids"] != v["gpu_ids"]
        assert d["torch_threads"] == v["torch_threads"] == 1
        table = ray_session.util.placement_group_table(dep.pg)
        assert table["state"] == "CREATED" and len(table["bundles"]) == 2
        assert all(b == {"GPU": 1.0, "CPU": 1.0} for b in table["bundles"].values())
        with SSDClient(dep.address) as client:
            res = client.complete(PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert list(res.token_ids) == greedy_reference(PROMPTS[0], 24)
    finally:
        dep.shutdown(grace_s=5)


def test_strict_spread_on_one_node_times_out(ray_session, toy_pair) -> None:
    from cluster.launch import LaunchOptions, PlacementError, launch
    from spec_core.settings import ServiceConfig

    with pytest.raises(PlacementError, match="not ready"):
        launch(ServiceConfig(target=toy_pair["target"], draft=toy_pair["draft"], strategy="STRICT_SPREAD", gpu="no"),
               options=LaunchOptions(placement_timeout_s=2))


def test_serve_streams_greedy_equal_to_ar_for_8_concurrent_clients(served, real_reference) -> None:
    """``ssd serve`` with no flags serves the real default pair; streams equal the target's own greedy output."""
    proc, info = served
    assert info["drafter"]["pid"] != info["verifier"]["pid"]
    assert info["drafter"]["placement_group_id"] == info["verifier"]["placement_group_id"]
    assert info["drafter"]["affinity"] != info["verifier"]["affinity"]  # pinned to separate cores
    assert info["verifier"]["lending"] is False  # fp32 never borrows the drafter's core
    expected = {p: real_reference(p, 24) for p in PROMPTS}

    def one(prompt: str):
        with SSDClient(info["address"]) as client:
            return prompt, client.generate_all(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, PROMPTS))
    for prompt, out in results:
        assert list(out.final.token_ids) == expected[prompt]
        assert out.streamed_token_ids == list(out.final.token_ids)
        assert out.streamed_text == out.final.text


def test_serve_health_and_reflection(served) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    _, info = served
    with SSDClient(info["address"]) as client:
        assert client.health() == "SERVING"
        assert client.health("") == "SERVING"
    with grpc.insecure_channel(info["address"]) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {"ssd.v1.Generation", "grpc.health.v1.Health"} <= services
    with grpc.insecure_channel(info["drafter"]["address"]) as ch:
        assert "ssd.v1.Drafter" in set(ProtoReflectionDescriptorDatabase(ch).get_services())


def test_serve_exports_prometheus_metrics(served) -> None:
    import urllib.request

    _, info = served
    with SSDClient(info["address"]) as client:
        client.complete(PROMPTS[2], SamplingParams(max_new_tokens=8))
    with urllib.request.urlopen(f"http://{info['verifier']['metrics_address']}/metrics", timeout=30) as r:
        text = r.read().decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "ssd_cache_hits_total", "ssd_cache_misses_total", "ssd_link_bytes_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "ssd_verify_seconds_bucket", "ssd_draft_seconds_bucket",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total{"):
        assert name in text, name
    count = [line for line in text.splitlines() if line.startswith("vllm:time_to_first_token_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1
    crossed = [line for line in text.splitlines() if line.startswith("ssd_host_device_crossings_total")]
    assert crossed and float(crossed[0].split()[-1]) >= 2  # at least one step: one upload, one download


@pytest.mark.stops_served
def test_client_cli_json_chat_and_sigterm(served, real_reference) -> None:
    """`ssd client generate` against `ssd serve` (real pair): a plain prompt and a chat turn, both equal to the
    target's own greedy output; the chat stream ends at the end-of-turn token with clean text."""
    from spec_core.chat import ChatPrompt

    proc, info = served
    out = subprocess.run([sys.executable, "-m", "ssd_cli", "client", "generate", "--address", info["address"],
                          "--prompt", PROMPTS[1], "--max-new-tokens", "16", "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["token_ids"] == real_reference(PROMPTS[1], 16) and obj["mode"] == "ssd"
    question = "What is the capital of France?"
    out = subprocess.run([sys.executable, "-m", "ssd_cli", "client", "generate", "--address", info["address"],
                          "--chat", question, "--max-new-tokens", "32", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    ref = real_reference(ChatPrompt.of([{"role": "user", "content": question}]), 32)
    assert obj["token_ids"] == ref[:ref.index(2) + 1] and obj["finish_reason"] == "stop"
    assert "Paris" in obj["text"] and "<|im_end|>" not in obj["text"]
    bad = subprocess.run([sys.executable, "-m", "ssd_cli", "client", "generate", "--address", info["address"],
                          "--prompt", "x", "--top-p", "2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "top_p" in bad.stderr and "Traceback" not in bad.stderr
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
