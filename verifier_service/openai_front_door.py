"""The OpenAI HTTP API's front door, before routing: the bearer token first (every path but ``/health``), then the
body limit (413 before a byte past it is read), bounded JSON parsing, and every refusal in OpenAI's error shape."""

from __future__ import annotations

import hmac
import json
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from verifier_service import openai_protocol as oa

logger = logging.getLogger("verifier_service.openai_http")

#: The default request-body limit: far above any prompt that fits a context, far below what hurts the server.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: Paths that answer without a token (load balancers' probes).
OPEN_PATHS = ("/health",)


def error_response(exc: oa.OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def too_large(limit: int) -> oa.OpenAIError:
    return oa.OpenAIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                          code="request_too_large")


def loads(raw: bytes) -> object:
    """JSON from a request body; a 400 for anything that is not JSON, nesting deeper than the parser's recursion
    bound included."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise oa.OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise oa.OpenAIError(400, "the request body is not valid JSON: nested too deeply") from None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read in chunks and refused (413) as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class FrontDoor:
    """ASGI middleware before routing: authentication first (every path but :data:`OPEN_PATHS` answers 401
    without the bearer token, unknown paths included), then a declared ``Content-Length`` over the limit answers 413
    without a byte of the body read."""

    def __init__(self, app, token: str | None, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self._expected = f"Bearer {token}".encode() if token else None

    def _authorized(self, scope: dict) -> bool:
        if self._expected is None or scope.get("path") in OPEN_PATHS:
            return True
        got = next((v for k, v in scope.get("headers") or () if k == b"authorization"), b"")
        return hmac.compare_digest(got, self._expected)

    def _refusal(self, scope: dict) -> oa.OpenAIError | None:
        if not self._authorized(scope):
            return oa.OpenAIError(401, "missing or invalid bearer token", code="invalid_api_key")
        declared = next((v for k, v in scope.get("headers") or () if k == b"content-length"), b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return too_large(self.max_body_bytes)
        return None

    async def __call__(self, scope, receive, send) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
            return
        headers = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None
        await JSONResponse(refusal.body(), status_code=refusal.status, headers=headers)(scope, receive, send)


async def http_error(request: Request, exc) -> Response:
    """Starlette's own refusals (an unknown path 404, a wrong method 405) in OpenAI's shape."""
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = oa.OpenAIError(exc.status_code, str(exc.detail), kind=kind).body()
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def internal_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s: %r", request.url.path, exc)
    return error_response(oa.OpenAIError(500, "internal server error", kind="server_error"))
