"""``SSDClient`` retries through gRPC's own retry policy (the channel's service config), against a fake server.

No model, no Ray: a plain ``grpc.server`` whose ``Generation`` methods fail with UNAVAILABLE on purpose. Checks:
unary calls are retried until they succeed; a stream is retried before its first message and never after it;
``retries`` above gRPC's cap of 5 attempts repeat the whole call; other codes and ``retries=0`` are not retried.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures

import grpc
import pytest
from local_ports import free_port

from protos.serving import MAX_RETRY_ATTEMPTS, retry_service_config
from protos.ssd.v1 import ssd_pb2 as pb
from protos.ssd.v1 import ssd_pb2_grpc
from spec_core.config import SamplingParams
from verifier_service.client import SSDClient

PARAMS = SamplingParams(max_new_tokens=2)


class FlakyGeneration(ssd_pb2_grpc.GenerationServicer):
    """Fails the first ``fail_first`` calls of each method with ``code``; ``Generate`` can also cut its stream
    after one delta (``cut_stream``)."""

    def __init__(self, fail_first: int = 0, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 cut_stream: bool = False) -> None:
        self.fail_first, self.code, self.cut_stream = fail_first, code, cut_stream
        self.calls = {"Complete": 0, "Generate": 0, "GetStats": 0}
        self.lock = threading.Lock()

    def _count(self, method: str, context) -> None:
        with self.lock:
            self.calls[method] += 1
            n = self.calls[method]
        if n <= self.fail_first:
            context.abort(self.code, f"attempt {n} refused")

    def Complete(self, request, context):  # noqa: N802 - gRPC method name
        self._count("Complete", context)
        return pb.GenerateResult(token_ids=[1, 2], text="ok")

    def Generate(self, request, context):  # noqa: N802
        if self.cut_stream:
            with self.lock:
                self.calls["Generate"] += 1
            yield pb.GenerateResponse(delta=pb.TokenDelta(token_ids=[1], text="a"))
            context.abort(grpc.StatusCode.UNAVAILABLE, "cut after the first token")
        self._count("Generate", context)
        yield pb.GenerateResponse(delta=pb.TokenDelta(token_ids=[1], text="a"))
        yield pb.GenerateResponse(final=pb.GenerateResult(token_ids=[1], text="a"))

    def GetStats(self, request, context):  # noqa: N802
        self._count("GetStats", context)
        return pb.StatsResponse()


@pytest.fixture
def serve():
    servers = []

    def start(servicer: FlakyGeneration) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        ssd_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def _client(address: str, retries: int) -> SSDClient:
    return SSDClient(address, timeout_s=20, retries=retries, backoff_s=0.01, max_backoff_s=0.05)


def test_service_config_is_grpcs_retry_policy() -> None:
    (method,) = json.loads(retry_service_config(5, 0.25, 4.0))["methodConfig"]
    assert method["name"] == [{"service": "ssd.v1.Generation"}]
    assert method["retryPolicy"] == {"maxAttempts": 5, "initialBackoff": "0.250s", "maxBackoff": "4.000s",
                                     "backoffMultiplier": 2.0, "retryableStatusCodes": ["UNAVAILABLE"]}
    with pytest.raises(ValueError):
        retry_service_config(MAX_RETRY_ATTEMPTS + 1, 0.25, 4.0)


def test_unary_retried_by_grpc_within_one_call(serve) -> None:
    servicer = FlakyGeneration(fail_first=3)
    with _client(serve(servicer), retries=4) as client:
        assert client.rounds == 1  # 5 attempts fit in gRPC's own policy: no loop of ours
        assert list(client.complete("x", PARAMS).token_ids) == [1, 2]
        assert list(client.generate_all("x", PARAMS).final.token_ids) == [1]
        client.stats()
    assert servicer.calls == {"Complete": 4, "Generate": 4, "GetStats": 4}


def test_retries_beyond_grpcs_cap_repeat_the_call(serve) -> None:
    servicer = FlakyGeneration(fail_first=7)
    with _client(serve(servicer), retries=9) as client:
        assert client.rounds == 2
        assert list(client.complete("x", PARAMS).token_ids) == [1, 2]
    assert servicer.calls["Complete"] == 8
    servicer = FlakyGeneration(fail_first=100)
    with _client(serve(servicer), retries=6) as client, pytest.raises(grpc.RpcError) as info:
        client.complete("x", PARAMS)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert servicer.calls["Complete"] == 2 * MAX_RETRY_ATTEMPTS  # retries rounded up to whole calls


@pytest.mark.parametrize("retries, code, calls", [
    (0, grpc.StatusCode.UNAVAILABLE, 1),
    (4, grpc.StatusCode.INVALID_ARGUMENT, 1),
    (4, grpc.StatusCode.RESOURCE_EXHAUSTED, 1),
])
def test_not_retried(serve, retries, code, calls) -> None:
    servicer = FlakyGeneration(fail_first=1, code=code)
    with _client(serve(servicer), retries=retries) as client, pytest.raises(grpc.RpcError) as info:
        client.complete("x", PARAMS)
    assert info.value.code() == code and servicer.calls["Complete"] == calls


def test_stream_never_retried_after_its_first_token(serve) -> None:
    servicer = FlakyGeneration(cut_stream=True)
    got = []
    with _client(serve(servicer), retries=9) as client, pytest.raises(grpc.RpcError) as info:
        for resp in client.generate("x", PARAMS):
            got.append(resp)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(got) == 1 and servicer.calls["Generate"] == 1  # nothing resent, nothing repeated


def test_server_down_then_up_is_ridden_out() -> None:
    """Connection refused counts as UNAVAILABLE; a server that comes up during the retries is reached."""
    port = free_port()
    servicer = FlakyGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    ssd_pb2_grpc.add_GenerationServicer_to_server(servicer, server)

    def start_later() -> None:
        time.sleep(1.0)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()

    threading.Thread(target=start_later, daemon=True).start()
    try:
        with SSDClient(f"127.0.0.1:{port}", timeout_s=20, retries=20, backoff_s=0.05, max_backoff_s=0.2) as client:
            assert list(client.complete("x", PARAMS).token_ids) == [1, 2]
    finally:
        server.stop(None)
    with SSDClient(f"127.0.0.1:{free_port()}", timeout_s=20, retries=0) as client:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            client.complete("x", PARAMS)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 5
