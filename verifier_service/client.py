"""A Python client for ``ssd.v1.Generation`` (what ``ssd client`` uses).

Every call carries a deadline. UNAVAILABLE (a starting, draining or restarting server) is retried with backoff
where that is safe: ``complete`` always (it is idempotent for seeded or greedy requests, and a failed call returned
nothing), ``generate`` only before the first token arrived (a stream cut mid-way raises UNAVAILABLE: resending
would repeat tokens the caller already has). Backoff doubles from ``backoff_s`` up to ``max_backoff_s``, so the
default retries ride out a restarting verifier actor (about 15 s in all).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import codec
from protos.serving import DEFAULT_DEADLINE_S, channel_options
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
        """``token``: bearer token for a server with authentication; ``tls_ca``: PEM of the CA that signed the
        server's certificate (turns on TLS)."""
        self.address = address
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        if tls_ca:
            from pathlib import Path

            creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(address, creds, options=channel_options())
        else:
            self.channel = grpc.insecure_channel(address, options=channel_options())
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
        stub = health_pb2_grpc.HealthStub(self.channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def _backoff(self, attempt: int) -> None:
        time.sleep(min(self.max_backoff_s, self.backoff_s * 2**attempt))

    def _retrying(self, fn):
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.retries:
                    raise
                logger.info("server unavailable (%s); retrying", exc.details())
                self._backoff(attempt)
        raise AssertionError("unreachable")

    def complete(self, prompt: str | list[int], params: SamplingParams, request_id: str = "") -> pb.GenerateResult:
        req = codec.params_to_request(prompt, params, request_id)
        return self._retrying(lambda: self.stub.Complete(req, timeout=self.timeout_s, metadata=self.metadata))

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str = "") -> Iterator[pb.GenerateResponse]:
        """Stream responses (deltas, then the final result)."""
        req = codec.params_to_request(prompt, params, request_id)
        for attempt in range(self.retries + 1):
            call = self.stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata)
            got_any = False
            try:
                for resp in call:
                    got_any = True
                    yield resp
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or got_any or attempt == self.retries:
                    raise
                logger.info("server unavailable (%s); retrying", exc.details())
                self._backoff(attempt)
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
        return self.stub.GetStats(pb.StatsRequest(), timeout=30, metadata=self.metadata)
