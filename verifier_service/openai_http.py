"""OpenAI-compatible HTTP over the ``ssd.v1.Generation`` gRPC API: the handlers, the FastAPI app, and the uvicorn
thread ``ssd serve --http-port`` runs next to the gRPC server.

One engine: every HTTP request becomes gRPC calls on the same ``Generation`` service (``n`` choices are ``n``
calls), so validation, limits, authentication (the ``Authorization`` header travels as gRPC metadata) and stats are
the gRPC server's own. The Ray Serve app mounts the same :class:`OpenAIHandlers` over its replica's channel.

The front door (:class:`FrontDoor`, before routing): with a token, every path but ``/health`` answers 401 unless
the bearer token matches; a body declared larger than ``max_body_bytes`` answers 413 unread, and one that grows
past it while read (chunked) answers 413 as soon as it does. JSON nested too deeply is a 400, not a crash.

A client that hangs up has its gRPC calls cancelled, streaming or not: the verifier frees the request's KV and tells
the drafter to free its own.

Errors come back in OpenAI's shape with a 4xx/5xx status, unknown paths and methods included: bad JSON and wrong
types 400, an unknown model 404, the server's own refusals mapped from their gRPC status
(:func:`openai_protocol.http_status`). A streamed request is answered with an error status when its first message
fails; an error after the first token ends the stream with an ``error`` event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from protos.ssd.v1 import ssd_pb2 as pb
from verifier_service import openai_protocol as oa
from verifier_service.openai_front_door import (
    DEFAULT_MAX_BODY_BYTES,
    FrontDoor,
    error_response,
    http_error,
    internal_error,
    loads,
    read_body,
)

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 3600.0
DONE = "data: [DONE]\n\n"
#: gRPC metadata: the caller's default ``max_new_tokens`` for a request that sets none (capped to its context).
DEFAULT_MAX_NEW_TOKENS_KEY = "ssd-default-max-new-tokens"
#: Internal request fields named in the server's messages, as the HTTP API names them.
_PARAM_NAMES = {"max_new_tokens": "max_tokens"}

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client hung up before its answer was ready."""


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _rpc_error(exc: grpc.aio.AioRpcError) -> oa.OpenAIError:
    status = oa.http_status(exc.code())
    kind = "invalid_request_error" if status < 500 else "server_error"
    message, param = exc.details() or exc.code().name, None
    for internal, public in _PARAM_NAMES.items():
        if internal in message:
            message, param = message.replace(internal, public), public
    return oa.OpenAIError(status, message, kind=kind, param=param, code=exc.code().name.lower())


async def _until_disconnected(request: Request) -> None:
    """Returns when the client hangs up. Only once the body is read: the next ASGI message is then the
    disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or :class:`ClientGone` once the client hangs up first; ``work`` is then cancelled (and
    with it its gRPC calls, which frees the request on the verifier and the drafter)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # its calls are cancelled before we go on
    raise ClientGone()


async def _complete_all(calls: list) -> list:
    """The results of unary calls; on the first failure, or when cancelled, none of them keeps generating."""
    try:
        return list(await asyncio.gather(*calls))
    finally:
        for c in calls:
            c.cancel()


async def _first_messages(calls: list) -> list:
    """Each stream's first message (the server validates before it); on a failure, or when cancelled, every
    stream is cancelled."""
    try:
        return [await c.read() for c in calls]
    except BaseException:
        for c in calls:
            c.cancel()
        raise


class OpenAIHandlers:
    """The endpoints, over a ``Generation`` stub. ``stub()`` returns a ``grpc.aio`` stub bound to the running loop;
    ``metrics()`` returns the Prometheus exposition (None: no ``/metrics``). ``token``: the bearer token the front
    door requires (None: no authentication here; the gRPC server still checks what it is given)."""

    def __init__(self, stub: Callable[[], object], model_names: list[str], health: Callable[[], object] | None = None,
                 metrics: Callable[[], bytes] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 token: str | None = None) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.stub, self.model_names, self.health_stub, self.metrics_text = stub, list(model_names), health, metrics
        self.max_body_bytes, self.token = max_body_bytes, token

    # ---- endpoints -------------------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, oa.ChatRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, oa.CompletionRequest, chat=False)

    async def models(self, request: Request) -> Response:
        return JSONResponse(oa.models(self.model_names))

    async def health(self, request: Request) -> Response:
        if self.health_stub is None:
            return Response(status_code=200)
        from grpc_health.v1 import health_pb2

        try:
            resp = await self.health_stub().Check(health_pb2.HealthCheckRequest(service="ssd.v1.Generation"),
                                                  timeout=10)
        except grpc.aio.AioRpcError:
            return Response(status_code=503)
        return Response(status_code=200 if resp.status == health_pb2.HealthCheckResponse.SERVING else 503)

    async def metrics(self, request: Request) -> Response:
        if self.metrics_text is None:
            return JSONResponse(oa.OpenAIError(404, "no metrics on this endpoint").body(), status_code=404)
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await asyncio.to_thread(self.metrics_text), media_type=CONTENT_TYPE_LATEST)

    # ---- generation ------------------------------------------------------------------------------------------
    async def _generate(self, request: Request, model_cls, chat: bool) -> Response:
        try:
            req = await self._parse(request, model_cls)
            to_pb = oa.chat_to_pb if chat else oa.completion_to_pb
            reqs = [to_pb(req, i) for i in range(req.n)]
        except oa.OpenAIError as exc:
            return error_response(exc)
        except ValueError as exc:  # a protobuf field out of range
            return error_response(oa.OpenAIError(400, str(exc)))
        metadata = _forwarded(request)
        if not chat and req.max_tokens is None:
            metadata += ((DEFAULT_MAX_NEW_TOKENS_KEY, str(oa.COMPLETION_MAX_TOKENS)),)
        cid = oa.new_id("chatcmpl" if chat else "cmpl")
        try:
            if not req.stream:
                calls = [self.stub().Complete(r, metadata=metadata, timeout=CALL_TIMEOUT_S) for r in reqs]
                results = await unless_disconnected(request, _complete_all(calls))
                return JSONResponse((oa.chat_completion if chat else oa.completion)(cid, req.model, results))
            calls = [self.stub().Generate(r, metadata=metadata, timeout=CALL_TIMEOUT_S) for r in reqs]
            firsts = await unless_disconnected(request, _first_messages(calls))
        except grpc.aio.AioRpcError as exc:
            return error_response(_rpc_error(exc))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        usage = bool(req.stream_options and req.stream_options.include_usage)
        stream = _Stream(cid, req.model, chat, usage, calls, firsts)
        return StreamingResponse(stream.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _parse(self, request: Request, model_cls):
        body = loads(await read_body(request, self.max_body_bytes))
        if not isinstance(body, dict):
            raise oa.OpenAIError(400, "the request body must be a JSON object")
        try:
            req = model_cls.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        except RecursionError:
            raise oa.OpenAIError(400, "the request is nested too deeply") from None
        if req.model is None:
            req.model = self.model_names[0]
        if req.model not in self.model_names:
            raise oa.OpenAIError(404, f"The model `{req.model}` does not exist.", param="model",
                                 code="model_not_found")
        extra = sorted(req.model_extra or ())
        if extra:
            logger.info("ignored request fields: %s", ", ".join(extra))
        req.check()
        return req


def _validation_error(exc: ValidationError) -> oa.OpenAIError:
    """A 400 naming the top-level field (``param``) and the most specific complaint: of a union's alternatives, a
    violated bound says more than "should be a valid string"."""
    errors = sorted(exc.errors(), key=lambda e: (e.get("type", "").endswith("_type"), -len(e.get("loc", ()))))
    best = errors[0]
    param = str(best["loc"][0]) if best.get("loc") else None
    return oa.OpenAIError(400, f"{param}: {best.get('msg')}" if param else str(best.get("msg")), param=param)


def _forwarded(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's token and address, as gRPC metadata: the server's per-client limits count HTTP clients apart."""
    auth = request.headers.get("authorization")
    client = (("ssd-forwarded-client", request.client.host),) if request.client else ()
    return ((("authorization", auth),) if auth else ()) + client


class _Stream:
    """Server-sent events of one streamed request: its ``n`` gRPC streams merged, one choice index each."""

    def __init__(self, cid: str, model: str, chat: bool, include_usage: bool, calls: list, firsts: list) -> None:
        self.cid, self.model, self.chat, self.include_usage = cid, model, chat, include_usage
        self.calls, self.firsts = calls, firsts
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.text_chars = [0] * len(calls)

    def _chunk(self, choice: dict) -> str:
        return _sse(oa.chunk(self.cid, self.model, self.chat, [choice], self.include_usage))

    def _on(self, i: int, resp: pb.GenerateResponse) -> list[str]:
        from protos import codec

        if resp.WhichOneof("kind") == "delta":
            d = resp.delta
            self.completion_tokens += len(d.token_ids)
            if self.chat:
                choice = {"index": i, "delta": {"content": d.text},
                          "logprobs": oa.chat_logprobs(d.token_logprobs), "finish_reason": None}
            else:
                choice = {"index": i, "text": d.text, "logprobs": oa.completion_logprobs(d.token_logprobs,
                                                                                         self.text_chars[i]),
                          "finish_reason": None}
            self.text_chars[i] += len(d.text)
            return [self._chunk(choice)] if d.text or d.token_ids else []
        final = resp.final
        self.prompt_tokens = final.num_prompt_tokens
        reason = codec.finish_reason_name(final.finish_reason)
        choice = ({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason} if self.chat
                  else {"index": i, "text": "", "logprobs": None, "finish_reason": reason})
        return [self._chunk(choice)]

    async def _pump(self, i: int, queue: asyncio.Queue) -> None:
        try:
            await queue.put((i, self.firsts[i]))
            while True:
                resp = await self.calls[i].read()
                if resp is grpc.aio.EOF:
                    break
                await queue.put((i, resp))
        except grpc.aio.AioRpcError as exc:
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    async def events(self) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()
        if self.chat:
            for i in range(len(self.calls)):
                yield self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})
        tasks = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self.calls))]
        try:
            live = len(tasks)
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, grpc.aio.AioRpcError):
                    yield _sse(_rpc_error(item).body())
                elif item is not grpc.aio.EOF:
                    for event in self._on(i, item):
                        yield event
            if self.include_usage:
                yield _sse({**oa.chunk(self.cid, self.model, self.chat, []),
                            "usage": oa.usage(self.prompt_tokens, self.completion_tokens)})
            yield DONE
        finally:  # the client went away, or we are done: nothing keeps generating
            for t in tasks:
                t.cancel()
            for c in self.calls:
                c.cancel()


def create_app(handlers: OpenAIHandlers):
    """A FastAPI app with the OpenAI routes, ``/health`` and ``/metrics``, behind the :class:`FrontDoor`; every
    error in OpenAI's shape."""
    from fastapi import FastAPI
    from starlette.exceptions import HTTPException

    app = FastAPI(title="ssd-serve", description="OpenAI-compatible API over speculative speculative decoding")
    app.add_api_route("/v1/chat/completions", handlers.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", handlers.completions, methods=["POST"])
    app.add_api_route("/v1/models", handlers.models, methods=["GET"])
    app.add_api_route("/health", handlers.health, methods=["GET"])
    app.add_api_route("/metrics", handlers.metrics, methods=["GET"])
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(FrontDoor, token=handlers.token, max_body_bytes=handlers.max_body_bytes)
    return app


class LoopbackStubs:
    """``grpc.aio`` stubs to a local gRPC address, created on first use inside the HTTP server's event loop."""

    def __init__(self, address: str, options=None) -> None:
        self.address, self.options = address, options
        self._channel = None

    def channel(self):
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=self.options)
        return self._channel

    def generation(self):
        from protos.ssd.v1 import ssd_pb2_grpc

        return ssd_pb2_grpc.GenerationStub(self.channel())

    def health(self):
        from grpc_health.v1 import health_pb2_grpc

        return health_pb2_grpc.HealthStub(self.channel())


class HttpServerThread:
    """uvicorn serving ``app`` on its own thread and event loop (signals stay with the main thread)."""

    def __init__(self, app, host: str, port: int) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="openai-http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> int:
        """Start serving; returns the bound port. Raises RuntimeError when the port cannot be bound."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (is the port free?)")
            time.sleep(0.02)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
