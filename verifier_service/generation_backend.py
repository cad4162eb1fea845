"""What the OpenAI HTTP handlers generate with (:class:`GenerationBackend`), and its two implementations: the
verifier's in-process :class:`verifier_service.frontend.FrontEnd` (``ssd serve --http-port``), and
:class:`GrpcBackend` over a ``Generation`` stub (the Ray Serve replica, whose verifier is another process).

Every submitted handle ends with ``cancel`` (idempotent): a request still running is cancelled, and the verifier
frees its KV and tells the drafter to free its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import grpc

from protos.ssd.v1 import ssd_pb2 as pb
from verifier_service.frontend import Caller, Chunk, GenerationError, GenerationRequest, Result
from verifier_service.frontend_pb import event_from_pb, metadata, request_to_pb, result_from_pb

#: A relayed call's deadline (a long generation is still one call).
CALL_TIMEOUT_S = 3600.0
HEALTH_TIMEOUT_S = 10.0


@runtime_checkable
class GenerationBackend(Protocol):
    """Submit a request, then either stream its events or wait for its result; always cancel its handle at the
    end. Refusals and failures raise :class:`GenerationError`, at ``submit`` or at the first event."""

    async def submit(self, request: GenerationRequest, caller: Caller) -> object: ...

    def stream(self, handle) -> AsyncIterator[Chunk | Result]: ...

    async def result(self, handle) -> Result: ...

    def cancel(self, handle) -> None: ...

    async def healthy(self) -> bool: ...


def _error(exc: grpc.aio.AioRpcError) -> GenerationError:
    return GenerationError(exc.code().name, exc.details() or exc.code().name)


@dataclass(slots=True)
class _Call:
    """A request for the stub, and its call once started."""

    message: pb.GenerateRequest
    metadata: tuple[tuple[str, str], ...]
    rpc: Any = None


class GrpcBackend:
    """:class:`GenerationBackend` over a verifier's gRPC API. ``stub()`` returns a ``Generation`` stub bound to the
    running loop, ``health()`` a ``Health`` stub (None: always healthy). The caller's token and address travel as
    metadata: the verifier authenticates and counts per-client limits itself."""

    def __init__(self, stub: Callable[[], Any], health: Callable[[], Any] | None = None,
                 timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.stub, self.health, self.timeout_s = stub, health, timeout_s

    async def submit(self, request: GenerationRequest, caller: Caller) -> _Call:
        return _Call(request_to_pb(request), metadata(request, caller))

    async def stream(self, call: _Call) -> AsyncIterator[Chunk | Result]:
        call.rpc = self.stub().Generate(call.message, metadata=call.metadata, timeout=self.timeout_s)
        try:
            async for resp in call.rpc:
                yield event_from_pb(resp)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def result(self, call: _Call) -> Result:
        call.rpc = self.stub().Complete(call.message, metadata=call.metadata, timeout=self.timeout_s)
        try:
            return result_from_pb(await call.rpc)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    def cancel(self, call: _Call) -> None:
        if call.rpc is not None:
            call.rpc.cancel()

    async def healthy(self) -> bool:
        if self.health is None:
            return True
        from grpc_health.v1 import health_pb2

        try:
            resp = await self.health().Check(health_pb2.HealthCheckRequest(service="ssd.v1.Generation"),
                                             timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING
