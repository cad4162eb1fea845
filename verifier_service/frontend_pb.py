"""The front end's typed requests and events (:mod:`verifier_service.frontend`) to and from ``ssd.v1`` messages:
the gRPC servicer reads requests and writes events with it, the gRPC-stub backend of the HTTP layer the reverse.

A request without ``max_new_tokens`` gets the caller's default (metadata :data:`DEFAULT_MAX_NEW_TOKENS_KEY`, e.g.
OpenAI's 16 for completions), else the server's, capped to what fits its context.
"""

from __future__ import annotations

from dataclasses import asdict

from protos import codec
from protos.ssd.v1 import ssd_pb2 as pb
from verifier_service.frontend import (
    Caller,
    Chunk,
    GenerationRequest,
    PositionLogprobs,
    RequestStats,
    Result,
    TokenLogprob,
)

#: gRPC metadata: the address of the HTTP client a local relay calls for (trusted from loopback only).
FORWARDED_CLIENT_KEY = "ssd-forwarded-client"
#: gRPC metadata: the caller's default ``max_new_tokens`` for a request that sets none (capped to its context).
DEFAULT_MAX_NEW_TOKENS_KEY = "ssd-default-max-new-tokens"


# ---- requests ------------------------------------------------------------------------------------------------
def request_from_pb(req: pb.GenerateRequest, default_max_new_tokens: int | None = None) -> GenerationRequest:
    """Parsed and checked by :func:`protos.codec.request_to_params` (ValueError with a user-facing message)."""
    prompt, params = codec.request_to_params(req)
    default = None if req.HasField("max_new_tokens") else (default_max_new_tokens or params.max_new_tokens)
    return GenerationRequest(prompt, params, req.request_id, default)


def request_to_pb(request: GenerationRequest) -> pb.GenerateRequest:
    out = codec.params_to_request(request.prompt, request.params, request.request_id)
    if request.default_max_new_tokens is not None:
        out.ClearField("max_new_tokens")
    return out


def metadata(request: GenerationRequest, caller: Caller) -> tuple[tuple[str, str], ...]:
    """What a relay sends along: the caller's token and address (so that the server's per-client limits count
    callers apart) and its default ``max_new_tokens``."""
    out: tuple[tuple[str, str], ...] = ()
    if caller.authorization:
        out += (("authorization", caller.authorization),)
    if caller.address != "unknown":
        out += ((FORWARDED_CLIENT_KEY, caller.address),)
    if request.default_max_new_tokens is not None:
        out += ((DEFAULT_MAX_NEW_TOKENS_KEY, str(request.default_max_new_tokens)),)
    return out


def default_max_new_tokens(invocation_metadata) -> int | None:
    """The caller's default ``max_new_tokens`` from its metadata, if it gave a valid one."""
    for key, value in invocation_metadata or ():
        if key == DEFAULT_MAX_NEW_TOKENS_KEY and str(value).isdigit() and int(value) > 0:
            return int(value)
    return None


# ---- events --------------------------------------------------------------------------------------------------
def _positions_to_pb(positions: list[PositionLogprobs]) -> list[pb.PositionLogprobs]:
    def tok(t: TokenLogprob) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob)

    return [pb.PositionLogprobs(chosen=tok(p.chosen), top=[tok(t) for t in p.top]) for p in positions]


def _positions_from_pb(positions) -> list[PositionLogprobs]:
    def tok(t: pb.TokenLogprob) -> TokenLogprob:
        return TokenLogprob(t.token_id, t.token, t.logprob)

    return [PositionLogprobs(tok(p.chosen), [tok(t) for t in p.top]) for p in positions]


def _finish_to_pb(name: str | None) -> int:
    return pb.FinishReason.Value(f"FINISH_REASON_{name.upper()}") if name else pb.FINISH_REASON_UNSPECIFIED


def result_to_pb(res: Result) -> pb.GenerateResult:
    return pb.GenerateResult(
        request_id=res.request_id, mode=res.mode, token_ids=res.token_ids, text=res.text,
        finish_reason=_finish_to_pb(res.finish_reason), num_prompt_tokens=res.num_prompt_tokens,
        logprobs=res.logprobs, stats=pb.RequestStats(**asdict(res.stats)),
        token_logprobs=_positions_to_pb(res.token_logprobs))


def result_from_pb(res: pb.GenerateResult) -> Result:
    s = res.stats
    stats = {name: getattr(s, name) for name in RequestStats.__dataclass_fields__}
    stats["acceptance_by_position"] = list(s.acceptance_by_position)
    return Result(request_id=res.request_id, mode=res.mode, token_ids=list(res.token_ids), text=res.text,
                  finish_reason=codec.finish_reason_name(res.finish_reason), num_prompt_tokens=res.num_prompt_tokens,
                  logprobs=list(res.logprobs), token_logprobs=_positions_from_pb(res.token_logprobs),
                  stats=RequestStats(**stats))


def event_to_pb(ev: Chunk | Result) -> pb.GenerateResponse:
    if isinstance(ev, Result):
        return pb.GenerateResponse(final=result_to_pb(ev))
    return pb.GenerateResponse(delta=pb.TokenDelta(token_ids=ev.token_ids, text=ev.text, logprobs=ev.logprobs,
                                                   token_logprobs=_positions_to_pb(ev.token_logprobs)))


def event_from_pb(resp: pb.GenerateResponse) -> Chunk | Result:
    if resp.WhichOneof("kind") == "final":
        return result_from_pb(resp.final)
    d = resp.delta
    return Chunk(list(d.token_ids), d.text, list(d.logprobs), _positions_from_pb(d.token_logprobs))
