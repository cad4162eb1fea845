"""Helpers of the hostile-client tests: an in-process SSD pair on the toy models behind the OpenAI front door, its
checks (:func:`whole`), bodies that must be refused, and clients that hang up or stream."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass

from drafter_service.server import DrafterServer, DrafterServerConfig
from spec_core.config import ModelConfig, SpeculationConfig, SSDConfig
from verifier_service.server import VerifierServer, VerifierServerConfig

#: The context limit of the served toy pair (its own 1024 positions): a stream of nearly this many tokens outlasts
#: every window a test measures.
MAX_MODEL_LEN = 1024
#: RSS may grow by at most this much over the whole module (one process holds client, verifier and drafter).
RSS_GROWTH_MB = 300
#: The issue's bars: a refused large body answers within this, and a concurrent stream never waits longer.
LATENCY_BAR_S = 2.0
TEN_MB = 10 * 1024 * 1024
TOKEN = "hostile-suite-token"
PROBE = {"model": "toy", "prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@dataclass
class Front:
    server: VerifierServer
    drafter: DrafterServer
    host: str
    port: int
    reference: str = ""
    rss0: float = 0.0

    def conn(self, timeout: float = 60.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None,
                timeout: float = 60.0) -> tuple[int, dict | None]:
        c = self.conn(timeout)
        try:
            data = body.encode() if isinstance(body, str) else body
            c.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            r = c.getresponse()
            raw = r.read()
        finally:
            c.close()
        return r.status, json.loads(raw) if raw else None

    def post(self, body: dict | str | bytes, path: str = "/v1/completions", **kw) -> tuple[int, dict | None]:
        return self.request("POST", path, json.dumps(body) if isinstance(body, dict) else body, **kw)

    def drafter_requests(self) -> int:
        session = self.drafter.servicer.session
        return len(session.loop.drafter.requests) if session is not None else 0

    def idle(self) -> bool:
        s = self.server.stats()
        return (s["running"] == 0 and s["queued"] == 0 and s["kv_usage"] == 0.0
                and not self.server.engine_loop.active and self.drafter_requests() == 0)

    def settle(self, timeout_s: float = 10.0) -> float:
        """Seconds until nothing runs on either side (fails after ``timeout_s``)."""
        t0 = time.monotonic()
        while not self.idle():
            assert time.monotonic() - t0 < timeout_s, f"still busy: {self.server.stats()}"
            time.sleep(0.02)
        return time.monotonic() - t0


def start_front(toy_pair, **verifier) -> Front:
    drafter = DrafterServer(DrafterServerConfig(ModelConfig(toy_pair["draft"]), SSDConfig(k=2)))
    drafter.start()
    cfg = VerifierServerConfig(ModelConfig(toy_pair["target"]), spec=SpeculationConfig(k=2), http_port=0,
                               served_model_name="toy", max_model_len=MAX_MODEL_LEN, **verifier)
    server = VerifierServer(cfg)
    server.start(drafter.address)
    host, port = server.http_address.rsplit(":", 1)
    return Front(server, drafter, host, int(port))


def stop_front(front: Front) -> None:
    front.server.stop()
    front.drafter.stop()


def whole(front: Front) -> None:
    """Nothing left running, a normal request answered exactly as before, and RSS within its bound."""
    front.settle()
    status, body = front.post(PROBE)
    assert status == 200 and body["choices"][0]["text"] == front.reference, body
    front.settle()
    assert rss_mb() - front.rss0 < RSS_GROWTH_MB, (rss_mb(), front.rss0)


def assert_openai_error(status: int, body: dict | None, expected: int) -> dict:
    assert status == expected, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


class Stream:
    """A streamed completion read on its own thread, each SSE event's arrival time kept."""

    def __init__(self, front: Front, max_tokens: int = MAX_MODEL_LEN - 16, prompt: str = "def f(x):",
                 **extra) -> None:
        self.conn = front.conn(timeout=120)
        body = {"model": "toy", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, **extra}
        self.conn.request("POST", "/v1/completions", body=json.dumps(body),
                          headers={"Content-Type": "application/json"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        self.times: list[float] = []
        self.events: list[str] = []
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.first.wait(60), "no first chunk"

    def _read(self) -> None:
        try:
            while line := self.response.fp.readline():
                if line.startswith(b"data: "):
                    self.times.append(time.monotonic())
                    self.events.append(line[6:].strip().decode())
                    self.first.set()
        except (OSError, ValueError, AttributeError):  # closed by the test: a hang-up
            pass

    def longest_gap(self, t0: float, t1: float) -> float:
        """The longest wait for an event within [t0, t1] (the window's edges count as events)."""
        assert self.times[-1] >= t1, "the stream ended inside the window"
        marks = [t0, *(t for t in self.times if t0 <= t <= t1), t1]
        return max(b - a for a, b in zip(marks, marks[1:]))

    def hang_up(self) -> None:
        self.conn.sock.shutdown(2)
        self.conn.close()
        self.thread.join(10)


NESTED = "[" * 100_000 + "]" * 100_000
CASES = [
    ("/v1/completions", "{not json", None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),
    ("/v1/completions", NESTED, None),
    ("/v1/chat/completions", NESTED, None),
    ("/v1/completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
    ("/v1/completions", json.dumps([1, 2]), None),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": True}), "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stream": "yes"}), "stream"),
    ("/v1/completions", json.dumps({"prompt": "hi", "n": "2"}), "n"),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": "hot"}), "temperature"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2 ** 63}), "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}), "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": [1, 2 ** 40]}), "prompt"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', None),
    ("/v1/completions", json.dumps({"prompt": "hi", "response_format": {"type": "json_object"}}), "response_format"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": True}),
     "max_tokens"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}),
     "stream"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                         "response_format": {"type": "json_schema"}}), "response_format"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                         "max_completion_tokens": 2 ** 63}), "max_completion_tokens"),
]


def _send_and_hang_up(front: Front, body: dict, after_s: float) -> None:
    c = front.conn()
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    time.sleep(after_s)
    c.sock.shutdown(2)
    c.close()


def probe_text(front: Front, stream: bool) -> str:
    """The probe's text, streamed or not (an HTTP error as ``HTTP <status>``)."""
    if not stream:
        status, body = front.post(PROBE)
        return body["choices"][0]["text"] if status == 200 else f"HTTP {status}"
    c = front.conn()
    try:
        c.request("POST", "/v1/completions", body=json.dumps({**PROBE, "stream": True}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        events = [json.loads(e[6:]) for e in r.read().decode().split("\n\n") if e.startswith("data: {")]
    finally:
        c.close()
    if r.status != 200:
        return f"HTTP {r.status}"
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
