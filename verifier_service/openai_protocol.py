"""OpenAI's request and response shapes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``), as pydantic
models and pure conversions: requests to ``ssd.v1`` protobuf messages (parsed as the gRPC API parses its own),
the front end's results (:mod:`verifier_service.frontend`) to responses.

Requests tolerate unknown fields, as vLLM does (they are logged and ignored), but the known ones are strictly typed
(``"max_tokens": true``, ``"stream": "yes"`` and ``"n": "2"`` are 400s). Fields that would change the target's
distribution (penalties, ``logit_bias``) or that we cannot honour (``echo``, ``best_of`` > 1, tools, a
``response_format`` other than text) are refused with a 400 rather than silently ignored. Defaults follow OpenAI:
``temperature`` 1, ``top_p`` 1, and ``max_tokens`` 16 for completions (:data:`COMPLETION_MAX_TOKENS`); chat leaves
``max_tokens`` to the server (128). An unset ``max_tokens`` is capped by the server to what fits the context, as vLLM
does.
Log-probabilities are the target's raw ones (before temperature and top-p), with token strings.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protos.ssd.v1 import ssd_pb2 as pb
from spec_core.config import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from verifier_service.frontend import Result

#: The most choices one request may ask for (each is its own generation).
MAX_N = 16
#: The largest ``max_tokens`` the wire format carries (``int32``); the context limit is checked by the server.
MAX_TOKENS_LIMIT = 2 ** 31 - 1
#: ``max_tokens`` of a completion that gives none (OpenAI's default), sent as the server's default.
COMPLETION_MAX_TOKENS = 16
#: Strict types on every request model: no bool-as-int, no string-as-number, no string-as-bool.
_STRICT = ConfigDict(extra="allow", strict=True)
#: A token id as the wire carries it.
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)]


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Common(BaseModel):
    """The sampling fields both endpoints share."""

    model_config = _STRICT
    model: str | None = None  # None: the served model (as vLLM allows)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOKENS_LIMIT)  # vLLM's extension; -1 and 0 mean off
    seed: int | None = Field(default=None, ge=0, lt=2 ** 64)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    user: str | None = None

    def refuse_unsupported(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise OpenAIError(400, f"{name} is not supported (it would change the target's distribution)",
                                  param=name)
        if self.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported (it would change the target's distribution)",
                              param="logit_bias")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise OpenAIError(400, "response_format is not supported (only {\"type\": \"text\"})",
                              param="response_format")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise OpenAIError(400, "only text content parts are supported", param="messages")
        return "".join(p.text or "" for p in self.content)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list | None = None

    def check(self) -> None:
        self.refuse_unsupported()
        if self.tools:
            raise OpenAIError(400, "tools are not supported", param="tools")
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


class CompletionRequest(_Common):
    prompt: str | list[str] | list[TokenId]
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("a list of several prompts is not supported; send one request per prompt")
            return v[0]
        if isinstance(v, list) and not v or v == "":
            raise ValueError("prompt is empty")
        return v

    def check(self) -> None:
        self.refuse_unsupported()
        if self.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise OpenAIError(400, "best_of > 1 is not supported", param="best_of")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")


# ---- requests → protobuf ----------------------------------------------------------------------------------------
def _sampling(req: _Common, choice: int) -> dict:
    out = {"temperature": 1.0 if req.temperature is None else req.temperature,
           "top_p": 1.0 if req.top_p is None else req.top_p,
           "top_k": max(0, req.top_k or 0), "stop": req.stops(), "stop_token_ids": req.stop_token_ids or [],
           "ignore_eos": req.ignore_eos}
    if req.seed is not None:
        out["seed"] = (req.seed + choice) % 2 ** 64  # n > 1: each choice its own stream, all reproducible
    return out


def chat_to_pb(req: ChatRequest, choice: int = 0) -> pb.GenerateRequest:
    out = pb.GenerateRequest(messages=[pb.ChatMessage(role=m.role, content=m.text()) for m in req.messages],
                             logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0, **_sampling(req, choice))
    limit = req.max_completion_tokens or req.max_tokens
    if limit is not None:
        out.max_new_tokens = limit
    return out


def completion_to_pb(req: CompletionRequest, choice: int = 0) -> pb.GenerateRequest:
    out = pb.GenerateRequest(logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
                             **_sampling(req, choice))
    if isinstance(req.prompt, str):
        out.prompt = req.prompt
    else:
        out.prompt_token_ids.extend(req.prompt)
    if req.max_tokens is not None:
        out.max_new_tokens = req.max_tokens
    return out


# ---- results → responses -----------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _tok(t) -> dict:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))}


def chat_logprobs(positions) -> dict | None:
    """``choices[i].logprobs`` of a chat completion (or chunk) from a result's ``token_logprobs``."""
    if not positions:
        return None
    return {"content": [{**_tok(p.chosen), "top_logprobs": [_tok(t) for t in p.top]} for p in positions],
            "refusal": None}


def completion_logprobs(positions, offset: int = 0) -> dict | None:
    """``choices[i].logprobs`` of a completion: tokens, their logprobs, top alternatives and text offsets."""
    if not positions:
        return None
    offsets, at = [], offset
    for p in positions:
        offsets.append(at)
        at += len(p.chosen.token)
    tops = [{t.token: t.logprob for t in p.top} for p in positions]
    return {"tokens": [p.chosen.token for p in positions], "token_logprobs": [p.chosen.logprob for p in positions],
            "top_logprobs": tops if any(p.top for p in positions) else None, "text_offset": offsets}


def chat_completion(cid: str, model: str, results: list[Result]) -> dict:
    choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                "logprobs": chat_logprobs(r.token_logprobs), "finish_reason": r.finish_reason}
               for i, r in enumerate(results)]
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(results[0].num_prompt_tokens, sum(len(r.token_ids) for r in results))}


def completion(cid: str, model: str, results: list[Result]) -> dict:
    choices = [{"index": i, "text": r.text, "logprobs": completion_logprobs(r.token_logprobs),
                "finish_reason": r.finish_reason} for i, r in enumerate(results)]
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(results[0].num_prompt_tokens, sum(len(r.token_ids) for r in results))}


def chunk(cid: str, model: str, chat: bool, choices: list[dict], with_usage: bool = False) -> dict:
    """One streamed chunk; with ``stream_options.include_usage`` every chunk has ``usage: null`` but the last."""
    obj = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices}
    if with_usage:
        obj["usage"] = None
    return obj


def models(names: list[str]) -> dict:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "ssd-serve"}
                                       for n in names]}


#: gRPC status → HTTP status of the OpenAI-shaped error.
def http_status(code) -> int:
    import grpc

    return {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
            grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
            grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
            grpc.StatusCode.DEADLINE_EXCEEDED: 504}.get(code, 500)
