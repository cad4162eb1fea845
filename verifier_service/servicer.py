"""The gRPC handlers of ``ssd.v1.Generation`` (:class:`GenerationServicer`): a thin adapter over the verifier's
in-process :class:`verifier_service.frontend.FrontEnd` (protobuf to and from the front end's types, its errors to
status codes). Validation, limits, request ids and stats are the front end's.

Status codes: INVALID_ARGUMENT (bad request, with a message), RESOURCE_EXHAUSTED (queue full, or the client's
requests in flight), UNAVAILABLE (starting or draining), INTERNAL (an engine failure; the server keeps serving). A
client that cancels (or whose deadline passes) has its request cancelled: KV blocks are freed here and on the
drafter. A request that does not parse as protobuf reaches the handler as :class:`Malformed` and gets
INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from protos import codec
from protos.security import is_loopback
from protos.ssd.v1 import ssd_pb2 as pb
from protos.ssd.v1 import ssd_pb2_grpc
from verifier_service.frontend import Caller, FrontEnd, GenerationError, Ticket
from verifier_service.frontend_pb import (
    FORWARDED_CLIENT_KEY,
    default_max_new_tokens,
    event_to_pb,
    request_from_pb,
    result_to_pb,
)

SERVICE = "ssd.v1.Generation"
__all__ = ["FORWARDED_CLIENT_KEY", "SERVICE", "GenerationServicer", "Malformed", "add_generation_servicer"]


def caller_of(context) -> Caller:
    """The caller: its bearer token if any, else its address. An HTTP client that a relay on this machine calls
    for (:data:`FORWARDED_CLIENT_KEY`, trusted from loopback only) is its own address, not the relay's."""
    metadata = dict(context.invocation_metadata() or ())
    auth = metadata.get("authorization")
    peer = (context.peer() or "unknown").rsplit(":", 1)[0]
    forwarded = metadata.get(FORWARDED_CLIENT_KEY)
    if forwarded and is_loopback(peer.split(":", 1)[-1]):
        return Caller(str(auth) if auth else None, str(forwarded), http=True)
    return Caller(str(auth) if auth else None, peer)


class GenerationServicer(ssd_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: FrontEnd) -> None:
        self.frontend = frontend

    async def _submit(self, request: pb.GenerateRequest, context) -> Ticket:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")
        try:
            req = request_from_pb(request, default_max_new_tokens(context.invocation_metadata()))
            return await self.frontend.submit(req, caller_of(context))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except GenerationError as exc:
            await context.abort(grpc.StatusCode[exc.status], exc.message)

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        ticket = await self._submit(request, context)
        try:
            async for ev in self.frontend.stream(ticket):
                yield event_to_pb(ev)
        except GenerationError as exc:
            await context.abort(grpc.StatusCode[exc.status], exc.message)
        finally:  # finished, failed, or the client went away (cancel, deadline): its KV freed on both sides
            self.frontend.cancel(ticket)

    async def Complete(self, request, context):  # noqa: N802
        ticket = await self._submit(request, context)
        try:
            return result_to_pb(await self.frontend.result(ticket))
        except GenerationError as exc:
            await context.abort(grpc.StatusCode[exc.status], exc.message)
        finally:
            self.frontend.cancel(ticket)

    async def GetStats(self, request, context):  # noqa: N802
        stats = self.frontend.stats()
        return pb.StatsResponse(
            mode=stats["mode"], running=stats["running"], queued=stats["queued"], kv_usage=stats["kv_usage"],
            tokens_emitted=stats["tokens_emitted"], rounds=stats["rounds"],
            acceptance_rate=stats["acceptance_rate"] or 0.0,
            mean_tokens_per_round=stats["mean_tokens_per_round"] or 0.0,
            cache_hit_rate=stats["cache_hit_rate"] or 0.0, drafter_connected=stats["drafter_connected"],
            stats=codec.stats_to_pb(stats))


@dataclass(frozen=True, slots=True)
class Malformed:
    """A request that did not parse as protobuf (the handler answers INVALID_ARGUMENT)."""

    error: str


def _tolerant(message_cls):
    from google.protobuf.message import DecodeError

    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as exc:
            return Malformed(str(exc))

    return parse


def add_generation_servicer(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Like the generated ``add_GenerationServicer_to_server``, but a request that does not parse (random bytes,
    invalid UTF-8 in a string field) reaches the handler as :class:`Malformed` and gets INVALID_ARGUMENT with the
    parser's message, instead of the library's UNKNOWN."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_tolerant(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Complete": grpc.unary_unary_rpc_method_handler(
            servicer.Complete, request_deserializer=_tolerant(pb.GenerateRequest),
            response_serializer=pb.GenerateResult.SerializeToString),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats, request_deserializer=_tolerant(pb.StatsRequest),
            response_serializer=pb.StatsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
