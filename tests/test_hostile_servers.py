"""Hostile clients against servers of their own (issue 48): the drafter link's bind address and token,
authentication before anything else, a drafter killed mid-stream, per-client limits over HTTP, a drain with
requests in flight, and the soak. Helpers: tests/hostile_front.py."""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time

import pytest
from hostile_front import (
    CASES,
    MAX_MODEL_LEN,
    NESTED,
    PROBE,
    TEN_MB,
    TOKEN,
    Front,
    Stream,
    _send_and_hang_up,
    assert_openai_error,
    probe_text,
    rss_mb,
    start_front,
    stop_front,
    whole,
)

from drafter_service.server import DrafterServer, DrafterServerConfig
from spec_core.config import ModelConfig, SpeculationConfig, SSDConfig
from verifier_service.server import VerifierServer, VerifierServerConfig


# ---- the drafter link ----------------------------------------------------------------------------------------------
def test_the_drafter_binds_loopback_on_one_node(monkeypatch, tmp_path) -> None:
    import ray

    from cluster.launch import drafter_bind_host, drafter_config, link_security, verifier_config
    from spec_core.settings import ServiceConfig

    nodes = {"bundles_to_node_id": {0: "a", 1: "a", 2: "b"}}
    monkeypatch.setattr(ray.util, "placement_group_table", lambda pg: nodes)
    assert drafter_bind_host("auto", object(), 0) == "127.0.0.1"  # drafter and verifier on node a
    assert drafter_bind_host("auto", object(), 1) == "node-ip"  # across nodes a and b
    assert drafter_bind_host("10.1.2.3", object(), 0) == "10.1.2.3"
    public = {"tls_cert": "/c.pem", "tls_key": "/k.pem", "auth_token_file": "/t"}
    assert link_security("127.0.0.1", public).drafter_tls is None
    beyond = link_security("node-ip", public)
    assert beyond.drafter_tls.cert == "/c.pem" and beyond.verifier_tls.ca == "/c.pem"
    assert beyond.auth_token_file == "/t"
    pair = ServiceConfig(target="/t", draft="/d", dtype="float32", **public)
    near = drafter_config(pair, "/t", "/d", "127.0.0.1")
    assert near.host == "127.0.0.1" and near.tls is None
    far = drafter_config(pair, "/t", "/d", "node-ip")
    assert far.tls is not None and far.auth_token_file == "/t"
    assert verifier_config(pair, "/t", "node-ip").internal_tls.ca == "/c.pem"


def test_a_drafter_with_a_token_refuses_a_link_without_it(toy_pair, tmp_path) -> None:
    from verifier_service.drafter_link import GrpcDrafterLink, HandshakeError

    (tmp_path / "token").write_text(TOKEN)
    drafter = DrafterServer(DrafterServerConfig(ModelConfig(toy_pair["draft"]), SSDConfig(k=2),
                                                auth_token_file=str(tmp_path / "token")))
    drafter.start()
    server = VerifierServer(VerifierServerConfig(ModelConfig(toy_pair["target"]), spec=SpeculationConfig(k=2),
                                                 auth_token_file=str(tmp_path / "token")))
    try:
        with pytest.raises(HandshakeError):
            GrpcDrafterLink(drafter.address, server.hello(), server.pair.target.vocab_size, connect_timeout_s=5)
        server.start(drafter.address)  # the verifier carries the public API's token to the drafter
        assert server.link.alive
    finally:
        server.stop()
        drafter.stop()


# ---- authentication first ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(toy_pair, tmp_path_factory):
    token = tmp_path_factory.mktemp("auth") / "token"
    token.write_text(TOKEN)
    server = VerifierServer(VerifierServerConfig(ModelConfig(toy_pair["target"]), spec=SpeculationConfig("ar", 0),
                                                 http_port=0, served_model_name="toy", auth_token_file=str(token)))
    server.start()
    host, port = server.http_address.rsplit(":", 1)
    yield Front(server, None, host, int(port))
    server.stop()


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/completions", "{not json"),
    ("POST", "/v1/completions", json.dumps({"model": "gpt-4o", "prompt": "hi"})),
    ("POST", "/v1/chat/completions", NESTED),
    ("POST", "/v1/completions", b"x" * TEN_MB),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/nope", None),
    ("DELETE", "/v1/completions", None),
])
def test_without_the_token_everything_but_health_is_401_first(guarded, method, path, body) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        err = assert_openai_error(*guarded.request(method, path, body, headers=headers), 401)
        assert "toy" not in err["message"]


def test_with_the_token_the_guarded_server_answers(guarded) -> None:
    c = guarded.conn()
    c.request("GET", "/health")
    assert c.getresponse().status == 200  # probes need no token
    c.close()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, body = guarded.request("GET", "/v1/models", headers=auth)
    assert status == 200 and body["data"][0]["id"] == "toy"
    status, body = guarded.post({**PROBE, "max_tokens": 3}, headers=auth)
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert guarded.post(b"x" * TEN_MB, headers=auth)[0] == 413


# ---- a killed drafter ----------------------------------------------------------------------------------------------
def test_a_drafter_killed_mid_stream_loses_nothing(toy_pair) -> None:
    """The verifier serves from its backup speculator: the stream in flight finishes with the very text it would
    have had, and nothing is left running."""
    f = start_front(toy_pair, stats_log_interval_s=None)
    try:
        body = {**PROBE, "max_tokens": 200}
        status, full = f.post(body)
        assert status == 200
        stream = Stream(f, max_tokens=200, prompt=PROBE["prompt"])
        f.drafter.stop()
        stream.thread.join(60)
        text = "".join(json.loads(e)["choices"][0]["text"] for e in stream.events if e.startswith("{"))
        assert stream.events[-1] == "[DONE]" and text == full["choices"][0]["text"]
        assert not f.server.link.alive
        s = f.server.stats()
        assert s["running"] == 0 and s["kv_usage"] == 0.0 and not f.server.engine_loop.active
        status, after = f.post(body)
        assert status == 200 and after["choices"][0]["text"] == full["choices"][0]["text"]
    finally:
        f.server.stop()


# ---- per-client limits over HTTP ---------------------------------------------------------------------------------
def test_http_clients_are_counted_apart(toy_pair) -> None:
    """Without tokens every HTTP request reaches gRPC from the front door's own address; the limits still count
    each HTTP client apart, so one cannot take the others' share."""
    server = VerifierServer(VerifierServerConfig(ModelConfig(toy_pair["target"]), spec=SpeculationConfig("ar", 0),
                                                 http_port=0, served_model_name="toy", max_streams_per_client=1,
                                                 max_model_len=MAX_MODEL_LEN, stats_log_interval_s=None))
    server.start()
    try:
        host, port = server.http_address.rsplit(":", 1)
        f = Front(server, None, host, int(port))
        stream = Stream(f)  # client 127.0.0.1 holds its one stream
        status, body = f.post(PROBE)
        assert status == 429 and "in flight" in body["error"]["message"], body
        other = http.client.HTTPConnection(host, int(port), timeout=60, source_address=("127.0.0.2", 0))
        other.request("POST", "/v1/completions", body=json.dumps(PROBE), headers={"Content-Type": "application/json"})
        r = other.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == PROBE["max_tokens"]
        other.close()
        stream.hang_up()
    finally:
        server.stop()


# ---- shutdown with requests in flight ----------------------------------------------------------------------------
def test_a_drain_with_requests_in_flight_ends_them_cleanly(toy_pair) -> None:
    """What SIGTERM does (``Deployment.shutdown`` drains the verifier): in-flight requests past the grace end with
    503 (or an error event, then ``[DONE]``), no handler is cancelled mid-flight and no thread dies."""
    f = start_front(toy_pair, stats_log_interval_s=None)
    records: list[logging.LogRecord] = []
    catcher = logging.Handler(logging.WARNING)
    catcher.emit = records.append
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.addHandler(catcher)
    logging.getLogger().addHandler(catcher)
    crashed: list = []
    hook, threading.excepthook = threading.excepthook, crashed.append
    try:
        got: dict = {}
        body = {"model": "toy", "prompt": "def f(x):", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
        plain = threading.Thread(target=lambda: got.update(plain=f.post(body)))
        plain.start()
        stream = Stream(f)
        while f.server.stats()["running"] < 2:
            time.sleep(0.01)
        t0 = time.monotonic()
        assert f.server.drain(grace_s=0.2) is False
        took = time.monotonic() - t0
        plain.join(30)
        stream.thread.join(30)
        f.drafter.stop()
    finally:
        threading.excepthook = hook
        uvicorn_log.removeHandler(catcher)
        logging.getLogger().removeHandler(catcher)
    err = assert_openai_error(*got["plain"], 503)
    assert "shutting down" in err["message"]
    assert stream.events[-1] == "[DONE]" and "shutting down" in stream.events[-2]
    assert not crashed, crashed
    messages = [r.getMessage() + str(r.exc_info) for r in records]
    assert not [m for m in messages if "CancelledError" in m or "Event loop is closed" in m or "Exception" in m]
    assert took < 10, took


# ---- the soak ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_soak_64_clients(toy_pair, report) -> None:
    """64 clients for ``SSD_SOAK_S`` seconds (default 300), streaming and not, 10% hanging up and 5% sending hostile
    bodies: every valid request answers the greedy reference, KV returns to 0 and RSS stays flat."""
    duration = float(os.environ.get("SSD_SOAK_S", "300"))
    f = start_front(toy_pair, stats_log_interval_s=None, max_streams_per_client=None, max_queue=128)
    try:
        status, body = f.post(PROBE)
        f.reference = body["choices"][0]["text"]
        f.rss0 = rss_mb()
        counts = {"ok": 0, "wrong": 0, "hung_up": 0, "hostile": 0}
        lock = threading.Lock()
        end = time.monotonic() + duration

        def client(i: int) -> None:
            n = 0
            while time.monotonic() < end:
                n += 1
                kind = (i * 7 + n) % 20
                if kind < 2:
                    _send_and_hang_up(f, {**PROBE, "max_tokens": 200, "n": 2}, 0.2)
                    key = "hung_up"
                elif kind == 2:
                    path, bad, _ = CASES[n % len(CASES)]
                    status, _ = f.post(bad, path)
                    key = "hostile" if 400 <= status < 500 else "wrong"
                else:
                    key = "ok" if probe_text(f, stream=bool(kind % 2)) == f.reference else "wrong"
                with lock:
                    counts[key] += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(duration + 120)
        elapsed = time.monotonic() - t0
        report(f"soak: 64 clients for {elapsed:.0f} s: {counts['ok']} valid requests "
               f"({counts['ok'] / elapsed:.1f}/s, {counts['ok'] * PROBE['max_tokens'] / elapsed:.0f} tokens/s), "
               f"{counts['hung_up']} hang-ups, {counts['hostile']} hostile; RSS +{rss_mb() - f.rss0:.0f} MB")
        assert counts["wrong"] == 0 and counts["ok"] > 0, counts
        whole(f)
    finally:
        stop_front(f)
