"""OpenAI-compatible ``/v1/completions`` and ``/v1/models``: request parsing and response shapes (pure functions).

Defaults follow OpenAI's completions API (``max_tokens`` 16, ``temperature`` 1). Supported fields: ``model``,
``prompt`` (a string or a list of token ids), ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``
(string or list), ``stream``, ``logprobs`` (the chosen tokens' log-probabilities; top alternatives are not
returned), ``user``. ``n`` > 1, ``best_of`` > 1 and ``echo`` are refused with a 400, never silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid

import grpc

from protos import codec
from protos.ssd.v1 import ssd_pb2 as pb
from spec_core.config import SamplingParams

_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "logprobs", "user",
          "n", "best_of", "echo", "stream_options", "frequency_penalty", "presence_penalty"}

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def parse_completion(body: object) -> tuple[pb.GenerateRequest, bool]:
    """(gRPC request, stream?) from a ``/v1/completions`` body; ValueError with an OpenAI-style message."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise ValueError(f"unsupported fields: {', '.join(unknown)}")
    for name in ("n", "best_of"):
        if body.get(name, 1) not in (1, None):
            raise ValueError(f"{name} > 1 is not supported")
    if body.get("echo"):
        raise ValueError("echo is not supported")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name, 0) not in (0, None):
            raise ValueError(f"{name} is not supported (it would change the target's distribution)")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
        raise ValueError("prompt must be a string or a list of token ids")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        params = SamplingParams(
            temperature=float(_num(body, "temperature", 1.0)), top_p=float(_num(body, "top_p", 1.0)),
            max_new_tokens=int(_num(body, "max_tokens", 16)), seed=body.get("seed"), stop=stop,
            logprobs=body.get("logprobs") not in (None, False, 0),
        )
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    stream = bool(body.get("stream", False))
    return codec.params_to_request(prompt, params), stream


def _num(body: dict, name: str, default: float):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number")
    return v


def _logprobs(tokens: list[str], logprobs: list[float], offsets: list[int]) -> dict:
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def completion(result: pb.GenerateResult, model: str, tokenizer=None) -> dict:
    choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason or None, "logprobs": None}
    if result.logprobs:
        toks = [tokenizer.decode([t]) for t in result.token_ids] if tokenizer else [str(t) for t in result.token_ids]
        choice["logprobs"] = _logprobs(toks, list(result.logprobs), [])
    n_gen = len(result.token_ids)
    return {
        "id": f"cmpl-{result.request_id or uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": result.num_prompt_tokens, "completion_tokens": n_gen,
                  "total_tokens": result.num_prompt_tokens + n_gen},
    }


def chunk(cid: str, model: str, text: str, finish_reason: str | None, logprobs: list[float] | None = None) -> str:
    """One server-sent event carrying a completion chunk."""
    choice = {"index": 0, "text": text, "finish_reason": finish_reason,
              "logprobs": {"token_logprobs": logprobs} if logprobs else None}
    obj = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": [choice]}
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"


def models(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "ssd-serve"}]}
