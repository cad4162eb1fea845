"""A Python client for ``ssd.v1.Generation`` (what ``ssd client`` uses).

Every call carries a deadline. UNAVAILABLE (a starting, draining or restarting server) is retried by gRPC itself,
through the channel's service config (:func:`protos.serving.retry_service_config`): gRPC retries an attempt only
while no response has arrived, so ``complete`` is retried whenever it failed with nothing returned (it is idempotent
for seeded or greedy requests) and ``generate`` only before its first token (a stream cut mid-way raises
UNAVAILABLE: resending would repeat tokens the caller already has). Backoff doubles from ``backoff_s`` up to
``max_backoff_s``.

gRPC caps a call at 5 attempts (4 retries). For ``retries`` above that, the client repeats the whole call, after
``max_backoff_s``, up to ``ceil((retries + 1) / 5)`` times in all, with the same rule for streams: so a call gets at
least ``retries`` retries (rounded up to whole calls of 5 attempts). The default (6: two calls, about 12 s in all)
rides out a restarting verifier actor.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import codec
from protos.serving import DEFAULT_DEADLINE_S, MAX_RETRY_ATTEMPTS, channel_options, retry_service_config
from protos.ssd.v1 import ssd_pb2 as pb
from protos.ssd.v1 import ssd_pb2_grpc
from spec_core.config import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamedGeneration:
    """What a streaming call produced: every delta as received, and the final result."""

    deltas: list[pb.TokenDelta] = field(default_factory=list)
    final: pb.GenerateResult | None = None

    @property
    def streamed_token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def streamed_text(self) -> str:
        return "".join(d.text for d in self.deltas)


class SSDClient:
    def __init__(self, address: str, timeout_s: float = DEFAULT_DEADLINE_S, retries: int = 6,
                 backoff_s: float = 0.25, token: str | None = None, tls_ca: str | None = None,
                 max_backoff_s: float = 4.0) -> None:
        """``retries``: retries on UNAVAILABLE (0: none); ``token``: bearer token for a server with authentication;
        ``tls_ca``: PEM of the CA that signed the server's certificate (turns on TLS)."""
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.address = address
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        attempts = min(retries + 1, MAX_RETRY_ATTEMPTS)
        #: whole calls made before giving up; each is up to ``attempts`` gRPC attempts
        self.rounds = math.ceil((retries + 1) / attempts)
        options = channel_options()
        if retries:  # the channel also reconnects at least as often as it retries
            cap = max(backoff_s, max_backoff_s)
            options = channel_options(retry_service_config(attempts, backoff_s, cap), max_reconnect_backoff_s=cap)
        if tls_ca:
            from pathlib import Path

            creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = ssd_pb2_grpc.GenerationStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SSDClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def health(self, service: str = "ssd.v1.Generation") -> str:
        """The health status (never retried: a probe should see the server as it is)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def _call_again(self, exc: grpc.RpcError, round_: int, got_any: bool = False) -> bool:
        """Whether to repeat a whole call that gRPC gave up on: UNAVAILABLE, nothing received, rounds left
        (then after ``max_backoff_s``)."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or got_any or round_ == self.rounds - 1:
            return False
        logger.info("server unavailable (%s); calling again", exc.details())
        time.sleep(self.max_backoff_s)
        return True

    def _unary(self, fn):
        for round_ in range(self.rounds):
            try:
                return fn()
            except grpc.RpcError as exc:
                if not self._call_again(exc, round_):
                    raise
        raise AssertionError("unreachable")

    def complete(self, prompt: str | list[int], params: SamplingParams, request_id: str = "") -> pb.GenerateResult:
        req = codec.params_to_request(prompt, params, request_id)
        return self._unary(lambda: self.stub.Complete(req, timeout=self.timeout_s, metadata=self.metadata))

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str = "") -> Iterator[pb.GenerateResponse]:
        """Stream responses (deltas, then the final result)."""
        req = codec.params_to_request(prompt, params, request_id)
        for round_ in range(self.rounds):
            call = self.stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata)
            got_any = False
            try:
                for resp in call:
                    got_any = True
                    yield resp
                return
            except grpc.RpcError as exc:
                if not self._call_again(exc, round_, got_any):
                    raise
            finally:
                call.cancel()

    def generate_all(self, prompt: str | list[int], params: SamplingParams, request_id: str = "") -> StreamedGeneration:
        out = StreamedGeneration()
        for resp in self.generate(prompt, params, request_id):
            if resp.WhichOneof("kind") == "delta":
                out.deltas.append(resp.delta)
            else:
                out.final = resp.final
        return out

    def stats(self) -> pb.StatsResponse:
        return self._unary(lambda: self.stub.GetStats(pb.StatsRequest(), timeout=30, metadata=self.metadata))
