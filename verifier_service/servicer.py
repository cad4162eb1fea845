"""The gRPC handlers of ``ssd.v1.Generation`` (:class:`GenerationServicer`), over a :class:`VerifierServer`'s
engine loop.

Status codes: INVALID_ARGUMENT (bad request, with a message), RESOURCE_EXHAUSTED (queue full), UNAVAILABLE
(starting or draining), INTERNAL (an engine failure; the server keeps serving). A client that cancels (or whose
deadline passes) has its request cancelled: KV blocks are freed here and on the drafter. A request that does not
parse as protobuf reaches the handler as :class:`Malformed` and gets INVALID_ARGUMENT.

Tokenising and chat templating run on a small thread pool, never on the event loop that relays every other
stream. A request without ``max_new_tokens`` gets the default capped to what fits its context. The engine keys
every request by an id the server assigns; a caller's ``request_id`` is only echoed in its result, so no client can
probe or block another's ids.
"""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc

from protos import codec
from protos.security import is_loopback
from protos.ssd.v1 import ssd_pb2 as pb
from protos.ssd.v1 import ssd_pb2_grpc
from verifier_service.service import Delta, Draining, Failed, Finished, QueueFull

if TYPE_CHECKING:
    from verifier_service.server import VerifierServer

SERVICE = "ssd.v1.Generation"
#: gRPC metadata: the address of the HTTP client the local OpenAI front door calls for (trusted from loopback only).
FORWARDED_CLIENT_KEY = "ssd-forwarded-client"
#: Threads that tokenise and template prompts (a bound on the CPU one burst of huge prompts can take).
TOKENIZE_THREADS = 2


def _stats_pb(finished: Finished) -> pb.RequestStats:
    seq, s = finished.seq, finished.stats
    decode_s = (seq.emit_times[-1] - seq.emit_times[0]) if len(seq.emit_times) > 1 else 0.0
    out = pb.RequestStats(ttft_s=finished.ttft_s, decode_s=decode_s,
                          tokens_per_s=(len(seq.output_ids) - 1) / decode_s if decode_s > 0 else 0.0)
    if s is not None and s.num_rounds:
        out.num_rounds = s.num_rounds
        out.mean_tokens_per_round = s.mean_tokens_per_round
        out.acceptance_rate = s.acceptance_rate or 0.0
        out.num_drafted, out.num_accepted = s.num_drafted, s.num_accepted
        out.num_plain_rounds = s.num_rounds - s.num_drafts
        out.acceptance_by_position.extend(s.acceptance_by_position())
    return out


def _default_max_new_tokens(context, default: int) -> int:
    """The caller's default ``max_new_tokens`` (metadata ``ssd-default-max-new-tokens``, e.g. OpenAI's 16 for
    completions), else ``default``."""
    for key, value in context.invocation_metadata() or ():
        if key == "ssd-default-max-new-tokens" and str(value).isdigit() and int(value) > 0:
            return int(value)
    return default


def _failure_code(ev: Failed) -> grpc.StatusCode:
    if ev.retryable:
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL if ev.message.startswith("internal error") else grpc.StatusCode.INVALID_ARGUMENT


class GenerationServicer(ssd_pb2_grpc.GenerationServicer):
    def __init__(self, server: VerifierServer) -> None:
        self.server = server
        self.streams_by_client: dict[str, int] = {}
        self._tokenize = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="ssd-tokenize")

    @staticmethod
    def _client_id(context) -> str:
        """A client is its bearer token if any, else its address. An HTTP client that the OpenAI front door on this
        machine calls for is its own address (:data:`FORWARDED_CLIENT_KEY`), not the front door's: one HTTP client
        cannot take every other's share of the per-client limits."""
        metadata = dict(context.invocation_metadata() or ())
        if "authorization" in metadata:
            return "token:" + hashlib.sha256(str(metadata["authorization"]).encode()).hexdigest()[:12]
        peer = (context.peer() or "unknown").rsplit(":", 1)[0]
        forwarded = metadata.get(FORWARDED_CLIENT_KEY)
        if forwarded and is_loopback(peer.split(":", 1)[-1]):
            return f"peer:http:{forwarded}"
        return "peer:" + peer

    def _check_client_limits(self, client: str, ids: list[int], params) -> None:
        c = self.server.config
        if c.max_prompt_tokens is not None and len(ids) > c.max_prompt_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens; this server allows {c.max_prompt_tokens} per request")
        if c.max_new_tokens_limit is not None and params.max_new_tokens > c.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens {params.max_new_tokens} exceeds this server's limit of "
                             f"{c.max_new_tokens_limit}")
        if c.max_streams_per_client is not None and self.streams_by_client.get(client, 0) >= c.max_streams_per_client:
            raise QueueFull(f"this client already has {c.max_streams_per_client} requests in flight")

    async def _submit(self, request: pb.GenerateRequest, context):
        srv = self.server
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")
        if srv.engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is starting")
        try:
            prompt, params = codec.request_to_params(request)
            ids = await asyncio.get_running_loop().run_in_executor(self._tokenize, srv.encode, prompt)
            if not request.HasField("max_new_tokens"):
                default = _default_max_new_tokens(context, params.max_new_tokens)
                params = replace(params, max_new_tokens=min(default, srv.context_limit - len(ids)))
            srv.check_limits(ids, params)
            client = self._client_id(context)
            self._check_client_limits(client, ids, params)
            seq = srv.engine_loop.new_sequence(ids, params)
            handle = srv.engine_loop.submit(seq, asyncio.get_running_loop())
            handle.client, handle.public_id = client, request.request_id or seq.request_id
            self.streams_by_client[client] = self.streams_by_client.get(client, 0) + 1
            return handle
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except Draining as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _result(self, finished: Finished, request_id: str) -> pb.GenerateResult:
        seq = finished.seq
        return pb.GenerateResult(
            request_id=request_id, mode=self.server.config.spec.mode, token_ids=seq.output_ids, text=seq.text,
            finish_reason=codec.finish_reason_to_pb(seq.finish_reason), num_prompt_tokens=len(seq.prompt_ids),
            logprobs=seq.output_logprobs, stats=_stats_pb(finished),
            token_logprobs=self._token_logprobs(seq.output_ids, seq.output_logprobs, seq.output_top_logprobs))

    def _token_logprobs(self, ids: list[int], logprobs: list[float], top: list) -> list[pb.PositionLogprobs]:
        """Per token: the chosen one and its alternatives, with their text pieces (empty without logprobs)."""
        if not logprobs:
            return []
        piece = self.server.token_piece
        return [codec.position_logprobs((t, lp), top[i] if top else [], piece)
                for i, (t, lp) in enumerate(zip(ids, logprobs))]

    def _done(self, handle) -> None:
        n = self.streams_by_client.get(handle.client, 1) - 1
        if n > 0:
            self.streams_by_client[handle.client] = n
        else:
            self.streams_by_client.pop(handle.client, None)
        if not handle.done:  # the client went away (cancel, deadline): free its KV on both sides
            self.server.engine_loop.cancel(handle)

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        handle = await self._submit(request, context)
        try:
            while True:
                ev = await handle.events.get()
                if isinstance(ev, Delta):
                    yield pb.GenerateResponse(delta=pb.TokenDelta(
                        token_ids=ev.token_ids, text=ev.text, logprobs=ev.logprobs,
                        token_logprobs=self._token_logprobs(ev.token_ids, ev.logprobs, ev.top_logprobs)))
                elif isinstance(ev, Finished):
                    yield pb.GenerateResponse(final=self._result(ev, handle.public_id))
                    return
                elif isinstance(ev, Failed):
                    await context.abort(_failure_code(ev), ev.message)
        finally:
            self._done(handle)

    async def Complete(self, request, context):  # noqa: N802
        handle = await self._submit(request, context)
        try:
            while True:
                ev = await handle.events.get()
                if isinstance(ev, Finished):
                    return self._result(ev, handle.public_id)
                if isinstance(ev, Failed):
                    await context.abort(_failure_code(ev), ev.message)
        finally:
            self._done(handle)

    async def GetStats(self, request, context):  # noqa: N802
        stats = self.server.stats()
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
