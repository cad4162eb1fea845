"""Load: many concurrent streaming clients against the SSD service for a while.

0 errors of any status, greedy outputs equal AR (sampled ones well-formed), p99 inter-token latency reported,
RSS growth after warm-up under 10%, every KV block free at the end. The 32-client, 60-second version is
``make soak`` (marked slow); CI runs a short one.
"""

from __future__ import annotations

import logging
import random
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from drafter_service.server import DrafterServer, DrafterServerConfig
from spec_core.config import ModelConfig, SamplingParams, SpeculationConfig, SSDConfig
from verifier_service.client import SSDClient
from verifier_service.scheduler import SchedulerConfig
from verifier_service.server import VerifierServer, VerifierServerConfig

logger = logging.getLogger(__name__)
PROMPTS = ["def add(a, b):\n", "import os\n", "class Node:\n", "for i in range(10):\n", "x = [", "# sort a list\n"]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _trimmed_rss_mb() -> float:
    """RSS after returning free heap pages to the OS (glibc), so allocator slack does not read as growth."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return _rss_mb()


class _Load:
    """Client threads streaming random prompts (half greedy, half sampled) until a deadline, tallying what they see."""

    def __init__(self, address: str, refs: dict[str, list[int]], max_new: int) -> None:
        self.address, self.refs, self.max_new = address, refs, max_new
        self.errors: list[str] = []
        self.itls: list[float] = []
        self.done = 0
        self.lock = threading.Lock()
        self.stop_at = 0.0

    def run(self, clients: int, seconds: float, seed0: int) -> None:
        """``clients`` threads (seeds ``seed0 + i``) for ``seconds``; returns when all have finished."""
        self.stop_at = time.monotonic() + seconds
        ts = [threading.Thread(target=self.worker, args=(seed0 + i,)) for i in range(clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        with SSDClient(self.address, retries=0) as client:
            while time.monotonic() < self.stop_at:
                prompt = rng.choice(PROMPTS)
                greedy = rng.random() < 0.5
                params = SamplingParams(max_new_tokens=self.max_new, ignore_eos=True,
                                        temperature=0.0 if greedy else 0.8, seed=rng.randrange(1 << 30))
                try:
                    self._one(client, prompt, greedy, params)
                except Exception as exc:  # noqa: BLE001 - every error counts
                    with self.lock:
                        self.errors.append(repr(exc))

    def _one(self, client: SSDClient, prompt: str, greedy: bool, params: SamplingParams) -> None:
        """One streamed request, checked (well-formed; the greedy reference when greedy) and tallied."""
        times, tokens = [], []
        final = None
        for resp in client.generate(prompt, params):
            if resp.WhichOneof("kind") == "delta":
                times.append(time.perf_counter())
                tokens.extend(resp.delta.token_ids)
            else:
                final = resp.final
        ok = final is not None and list(final.token_ids) == tokens and len(tokens) == self.max_new
        ok = ok and all(0 <= t < 8192 for t in tokens) and (not greedy or tokens == self.refs[prompt])
        with self.lock:
            if not ok:
                self.errors.append(f"bad output for {prompt!r} greedy={greedy}")
            self.itls.extend(b - a for a, b in zip(times, times[1:]))
            self.done += 1


def _soak(toy_pair, greedy_reference, clients: int, seconds: float, max_new: int) -> dict:
    drafter = DrafterServer(DrafterServerConfig(ModelConfig(toy_pair["draft"]), SSDConfig(k=2)))
    drafter.start()
    server = VerifierServer(VerifierServerConfig(ModelConfig(toy_pair["target"]), spec=SpeculationConfig(k=2),
                                                 max_queue=max(32, clients), max_streams_per_client=None))
    address = server.start(drafter.address)
    load = _Load(address, {p: greedy_reference(p, max_new) for p in PROMPTS}, max_new)
    try:
        # warm-up, then measure RSS growth over the loaded period
        load.run(clients, min(5.0, seconds / 3), seed0=100)
        rss0 = _trimmed_rss_mb()
        load.run(clients, seconds, seed0=0)
        rss1 = _trimmed_rss_mb()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (server.stats()["admitted"] or server.stats()["kv_usage"]):
            time.sleep(0.1)
        stats = server.stats()
        itls = sorted(load.itls)
        report = {"requests": load.done, "errors": load.errors[:5], "num_errors": len(load.errors),
                  "itl_p99_s": itls[int(0.99 * (len(itls) - 1))] if itls else None,
                  "rss_growth": (rss1 - rss0) / rss0, "kv_usage": stats["kv_usage"], "admitted": stats["admitted"]}
        logger.warning("soak: %s", report)
        return report
    finally:
        server.stop()
        drafter.stop()


def _check(report: dict) -> None:
    assert report["num_errors"] == 0, report
    assert report["requests"] > 0 and report["itl_p99_s"] is not None
    assert report["rss_growth"] < 0.10, report
    assert report["kv_usage"] == 0.0 and report["admitted"] == 0, report


def test_short_load(toy_pair, greedy_reference) -> None:
    _check(_soak(toy_pair, greedy_reference, clients=8, seconds=8, max_new=16))


@pytest.mark.slow
def test_soak_32_clients_60s(toy_pair, greedy_reference) -> None:
    _check(_soak(toy_pair, greedy_reference, clients=32, seconds=60, max_new=32))


def test_overload_is_resource_exhausted_not_oom(toy_pair, greedy_reference) -> None:
    """Backpressure: five bursts of 64 simultaneous streams with long prompts against a queue limit of 16. The excess
    gets RESOURCE_EXHAUSTED at once (never queued without bound, never an out-of-memory kill), every admitted
    stream finishes with the target's greedy output, memory stays flat from burst to burst, and the server keeps
    serving with every KV block free."""
    import grpc

    drafter = DrafterServer(DrafterServerConfig(ModelConfig(toy_pair["draft"]), SSDConfig(k=2)))
    drafter.start()
    server = VerifierServer(VerifierServerConfig(ModelConfig(toy_pair["target"]), spec=SpeculationConfig(k=2), max_queue=16,
                                                 scheduler=SchedulerConfig(max_num_seqs=8),
                                                 max_streams_per_client=None))
    prompt = "values = [\n" + "    1,\n" * 120
    ref = greedy_reference(prompt, 24)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)

    def burst(pool: ThreadPoolExecutor, clients: list[SSDClient]) -> dict[str, int]:
        go = threading.Barrier(len(clients))

        def one(client: SSDClient) -> str:
            go.wait()
            try:
                out = client.generate_all(prompt, params)
                return "ok" if list(out.final.token_ids) == out.streamed_token_ids == ref else "other"
            except grpc.RpcError as exc:
                return "exhausted" if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "other"

        results = list(pool.map(one, clients))
        return {key: results.count(key) for key in ("ok", "exhausted", "other")}

    try:
        address = server.start(drafter.address)
        # the same 64 client threads every burst, so the client side's own memory (thread arenas) is steady
        clients = [SSDClient(address, retries=0) for _ in range(64)]
        counts, rss = [], []
        with ThreadPoolExecutor(64) as pool:
            for _ in range(5):  # 2 warm-up bursts (allocations that stay), then 3 measured
                counts.append(burst(pool, clients))
                rss.append(_trimmed_rss_mb())
        for c in clients:
            c.close()
        logger.warning("overload bursts: %s; RSS after each (MB): %s", counts, [round(r) for r in rss])
        for c in counts:
            assert c["other"] == 0 and c["exhausted"] > 0 and c["ok"] >= 16, counts
        assert max(rss[2:]) < 1.10 * max(rss[:2]), rss
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (server.stats()["admitted"] or server.stats()["kv_usage"]):
            time.sleep(0.1)
        assert server.stats()["kv_usage"] == 0.0 and server.stats()["admitted"] == 0
        with SSDClient(address) as client:
            assert list(client.complete(prompt, params).token_ids) == ref
    finally:
        server.stop()
        drafter.stop()
