"""OpenAI-compatible HTTP over a :class:`~verifier_service.generation_backend.GenerationBackend`: the handlers, the
FastAPI app, and the HTTP server ``ssd serve --http-port`` runs on the gRPC server's event loop.

One engine, one front end: under ``ssd serve`` the handlers call the verifier's in-process
:class:`~verifier_service.frontend.FrontEnd`, the very one the gRPC handlers call (``n`` choices are ``n``
submissions), so validation, limits, request ids and stats are the same whichever door a request came in by. The
Ray Serve app mounts the same :class:`OpenAIHandlers` over its replica's gRPC channel
(:class:`~verifier_service.generation_backend.GrpcBackend`; the ``Authorization`` header travels as metadata).

The front door (:class:`FrontDoor`, before routing): with a token, every path but ``/health`` answers 401 unless
the bearer token matches; a body declared larger than ``max_body_bytes`` answers 413 unread, and one that grows
past it while read (chunked) answers 413 as soon as it does. JSON nested too deeply is a 400, not a crash.

A client that hangs up has its requests cancelled, streaming or not: the verifier frees the request's KV and tells
the drafter to free its own.

Errors come back in OpenAI's shape with a 4xx/5xx status, unknown paths and methods included: bad JSON and wrong
types 400, an unknown model 404, the server's own refusals mapped from their gRPC status name
(:func:`openai_protocol.http_status`). A streamed request is answered with an error status when its first event
fails; an error after the first token ends the stream with an ``error`` event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from verifier_service import openai_protocol as oa
from verifier_service.frontend import Caller, Chunk, GenerationError, GenerationRequest, Result
from verifier_service.frontend_pb import request_from_pb
from verifier_service.generation_backend import GenerationBackend, GrpcBackend
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

DONE = "data: [DONE]\n\n"
#: Internal request fields named in the server's messages, as the HTTP API names them.
_PARAM_NAMES = {"max_new_tokens": "max_tokens"}

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client hung up before its answer was ready."""


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _refusal(exc: GenerationError) -> oa.OpenAIError:
    code = grpc.StatusCode[exc.status] if exc.status in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN
    status = oa.http_status(code)
    kind = "invalid_request_error" if status < 500 else "server_error"
    message, param = exc.message or exc.status, None
    for internal, public in _PARAM_NAMES.items():
        if internal in message:
            message, param = message.replace(internal, public), public
    return oa.OpenAIError(status, message, kind=kind, param=param, code=exc.status.lower())


async def _until_disconnected(request: Request) -> None:
    """Returns when the client hangs up. Only once the body is read: the next ASGI message is then the
    disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or :class:`ClientGone` once the client hangs up first; ``work`` is then cancelled (and
    with it its requests, which frees them on the verifier and the drafter)."""
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
    await asyncio.wait({task})  # its requests are cancelled before we go on
    raise ClientGone()


async def _submit_all(backend: GenerationBackend, requests: list[GenerationRequest], caller: Caller) -> list:
    """One handle per request; on a refusal, or when cancelled, none of them keeps generating."""
    handles: list = []
    try:
        for r in requests:
            handles.append(await backend.submit(r, caller))
    except BaseException:
        for h in handles:
            backend.cancel(h)
        raise
    return handles


async def _complete_all(backend: GenerationBackend, requests: list[GenerationRequest], caller: Caller) -> list:
    """The results of all requests; on the first failure, or when cancelled, none of them keeps generating."""
    handles = await _submit_all(backend, requests, caller)
    tasks = [asyncio.ensure_future(backend.result(h)) for h in handles]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        for h in handles:
            backend.cancel(h)


async def _open_streams(backend: GenerationBackend, requests: list[GenerationRequest], caller: Caller) -> tuple:
    """(handles, their event streams, each stream's first event): a request that fails before its first event
    answers with an error status. On a failure, or when cancelled, every request is cancelled."""
    handles = await _submit_all(backend, requests, caller)
    streams = [backend.stream(h) for h in handles]
    try:
        firsts = [await anext(s) for s in streams]
    except BaseException:
        for h in handles:
            backend.cancel(h)
        raise
    return handles, streams, firsts


class OpenAIHandlers:
    """The endpoints, over a :class:`GenerationBackend`. ``backend`` may also be a function returning a
    ``grpc.aio`` ``Generation`` stub bound to the running loop (with ``health`` one returning a ``Health`` stub):
    it is then wrapped in a :class:`GrpcBackend`. ``metrics()`` returns the Prometheus exposition (None: no
    ``/metrics``). ``token``: the bearer token the front door requires (None: no authentication here; a gRPC
    verifier still checks what it is given)."""

    def __init__(self, backend: GenerationBackend | Callable[[], object], model_names: list[str],
                 health: Callable[[], object] | None = None, metrics: Callable[[], bytes] | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, token: str | None = None) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if not isinstance(backend, GenerationBackend):
            backend = GrpcBackend(backend, health)
        self.backend: GenerationBackend = backend
        self.model_names, self.metrics_text = list(model_names), metrics
        self.max_body_bytes, self.token = max_body_bytes, token

    # ---- endpoints -------------------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, oa.ChatRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, oa.CompletionRequest, chat=False)

    async def models(self, request: Request) -> Response:
        return JSONResponse(oa.models(self.model_names))

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if await self.backend.healthy() else 503)

    async def metrics(self, request: Request) -> Response:
        if self.metrics_text is None:
            return JSONResponse(oa.OpenAIError(404, "no metrics on this endpoint").body(), status_code=404)
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await asyncio.to_thread(self.metrics_text), media_type=CONTENT_TYPE_LATEST)

    # ---- generation ------------------------------------------------------------------------------------------
    async def _generate(self, request: Request, model_cls, chat: bool) -> Response:
        try:
            req = await self._parse(request, model_cls)
            reqs = _requests(req, chat)
        except oa.OpenAIError as exc:
            return error_response(exc)
        except ValueError as exc:  # a field out of the wire's range, or refused by the request parser
            return error_response(oa.OpenAIError(400, str(exc)))
        caller = _caller(request)
        cid = oa.new_id("chatcmpl" if chat else "cmpl")
        try:
            if not req.stream:
                results = await unless_disconnected(request, _complete_all(self.backend, reqs, caller))
                return JSONResponse((oa.chat_completion if chat else oa.completion)(cid, req.model, results))
            handles, streams, firsts = await unless_disconnected(request, _open_streams(self.backend, reqs, caller))
        except GenerationError as exc:
            return error_response(_refusal(exc))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        usage = bool(req.stream_options and req.stream_options.include_usage)
        stream = _Stream(cid, req.model, chat, usage, (self.backend, handles, streams), firsts)
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


def _requests(req, chat: bool) -> list[GenerationRequest]:
    """One request per choice, parsed as the gRPC API parses its own; a completion without ``max_tokens`` gets
    OpenAI's default, capped to what fits its context."""
    to_pb = oa.chat_to_pb if chat else oa.completion_to_pb
    default = oa.COMPLETION_MAX_TOKENS if not chat and req.max_tokens is None else None
    return [request_from_pb(to_pb(req, i), default) for i in range(req.n)]


def _caller(request: Request) -> Caller:
    """The HTTP client: its token and its own address (the per-client limits count HTTP clients apart)."""
    return Caller(request.headers.get("authorization"), request.client.host if request.client else "unknown",
                  http=True)


class _Stream:
    """Server-sent events of one streamed request: its ``n`` event streams merged, one choice index each.
    ``requests``: (the backend, the handles, their event streams)."""

    def __init__(self, cid: str, model: str, chat: bool, include_usage: bool, requests: tuple, firsts: list) -> None:
        self.cid, self.model, self.chat, self.include_usage = cid, model, chat, include_usage
        self.backend, self.handles, self.streams = requests
        self.firsts = firsts
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.text_chars = [0] * len(self.handles)

    def _chunk(self, choice: dict) -> str:
        return _sse(oa.chunk(self.cid, self.model, self.chat, [choice], self.include_usage))

    def _on(self, i: int, ev: Chunk | Result) -> list[str]:
        if isinstance(ev, Chunk):
            self.completion_tokens += len(ev.token_ids)
            if self.chat:
                choice = {"index": i, "delta": {"content": ev.text},
                          "logprobs": oa.chat_logprobs(ev.token_logprobs), "finish_reason": None}
            else:
                choice = {"index": i, "text": ev.text,
                          "logprobs": oa.completion_logprobs(ev.token_logprobs, self.text_chars[i]),
                          "finish_reason": None}
            self.text_chars[i] += len(ev.text)
            return [self._chunk(choice)] if ev.text or ev.token_ids else []
        self.prompt_tokens = ev.num_prompt_tokens
        choice = ({"index": i, "delta": {}, "logprobs": None, "finish_reason": ev.finish_reason} if self.chat
                  else {"index": i, "text": "", "logprobs": None, "finish_reason": ev.finish_reason})
        return [self._chunk(choice)]

    async def _pump(self, i: int, queue: asyncio.Queue) -> None:
        try:
            await queue.put((i, self.firsts[i]))
            if not isinstance(self.firsts[i], Result):
                async for ev in self.streams[i]:
                    await queue.put((i, ev))
        except GenerationError as exc:
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    async def events(self) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()
        if self.chat:
            for i in range(len(self.handles)):
                yield self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})
        tasks = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self.handles))]
        try:
            live = len(tasks)
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, GenerationError):
                    yield _sse(_refusal(item).body())
                else:
                    for event in self._on(i, item):
                        yield event
            if self.include_usage:
                yield _sse({**oa.chunk(self.cid, self.model, self.chat, []),
                            "usage": oa.usage(self.prompt_tokens, self.completion_tokens)})
            yield DONE
        finally:  # the client went away, or we are done: nothing keeps generating
            for t in tasks:
                t.cancel()
            for h in self.handles:
                self.backend.cancel(h)


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


class HttpServer:
    """uvicorn serving ``app`` as a task on a running event loop of another thread (the gRPC server's): one loop
    for both doors. Signals stay with the main thread."""

    def __init__(self, app, host: str, port: int) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                                    timeout_graceful_shutdown=5))
        self._done: concurrent.futures.Future | None = None

    async def _serve(self) -> None:
        try:
            await self.server.serve()
        except SystemExit:  # uvicorn exits when it cannot bind; the loop it shares must keep running
            logger.error("the HTTP server could not start")

    def start(self, loop: asyncio.AbstractEventLoop, timeout_s: float = 30.0) -> int:
        """Start serving on ``loop``; returns the bound port. Raises RuntimeError when the port cannot be bound."""
        self._done = asyncio.run_coroutine_threadsafe(self._serve(), loop)
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if self._done.done() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (is the port free?)")
            time.sleep(0.02)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let responses in flight end (up to uvicorn's graceful timeout), wait up to ``timeout_s``."""
        self.server.should_exit = True
        if self._done is not None:
            try:
                self._done.result(timeout_s)
            except Exception as exc:  # noqa: BLE001 - shutting down: say why, never raise
                logger.warning("the HTTP server did not stop cleanly: %r", exc)
