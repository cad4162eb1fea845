"""The verifier's one in-process front end (:class:`FrontEnd`): what every door (the gRPC servicer, the OpenAI HTTP
handlers) calls to generate. Validation, the per-client limits, request ids and per-request stats live here only.

A request's life: :meth:`FrontEnd.submit` (tokenise on a small thread pool, never on the event loop; check the
context and the per-client limits; admit to the :class:`EngineLoop`, bound to the caller's event loop), then
:meth:`FrontEnd.stream` (:class:`Chunk` events, then one :class:`Result`; a failure raises
:class:`GenerationError`), and always :meth:`FrontEnd.cancel` at the end (idempotent: a request still running is
cancelled, its KV freed on the verifier and the drafter; the client's slot is given back once).

The engine keys every request by an id the front end assigns; a caller's ``request_id`` is only echoed in its
:class:`Result`, so no client can probe or block another's ids. Errors carry a gRPC status name
(:attr:`GenerationError.status`): each door maps it to its own codes.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from spec_core.chat import Prompt
from spec_core.config import SamplingParams
from verifier_service.service import Delta, Draining, Failed, Finished, Handle, QueueFull

if TYPE_CHECKING:
    from verifier_service.server import VerifierServer

#: Threads that tokenise and template prompts (a bound on the CPU one burst of huge prompts can take).
TOKENIZE_THREADS = 2


# ---- requests in ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks. A client is its bearer token if any, else its address; a client that came in over HTTP is its own
    address (``http``), never the address of what relayed it, so one HTTP client cannot take every other's share."""

    authorization: str | None = None
    address: str = "unknown"
    http: bool = False

    @property
    def key(self) -> str:
        if self.authorization:
            return "token:" + hashlib.sha256(self.authorization.encode()).hexdigest()[:12]
        return "peer:" + ("http:" if self.http else "") + self.address


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation. ``default_max_new_tokens``: None when ``params.max_new_tokens`` is the caller's own; else the
    caller set none, and gets this default capped to what fits the context."""

    prompt: Prompt
    params: SamplingParams
    request_id: str = ""
    default_max_new_tokens: int | None = None


# ---- events out ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """One generated position: the chosen token and its ``top_logprobs`` alternatives, with their text."""

    chosen: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Chunk:
    """New tokens of a running request; the chunks of a request concatenate exactly to its result."""

    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    token_logprobs: list[PositionLogprobs] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RequestStats:
    ttft_s: float = 0.0
    decode_s: float = 0.0
    tokens_per_s: float = 0.0
    num_rounds: int = 0
    mean_tokens_per_round: float = 0.0
    acceptance_rate: float = 0.0
    num_drafted: int = 0
    num_accepted: int = 0
    num_plain_rounds: int = 0
    acceptance_by_position: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Result:
    """A finished request. ``finish_reason``: "stop", "length", "abort" (cancelled), or None."""

    request_id: str
    mode: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    logprobs: list[float] = field(default_factory=list)
    token_logprobs: list[PositionLogprobs] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)


class GenerationError(Exception):
    """A refused or failed request. ``status``: a gRPC status name (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
    UNAVAILABLE, INTERNAL, ...)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(slots=True)
class Ticket:
    """A submitted request: its engine handle, its client and the id its caller knows it by."""

    handle: Handle
    client: str
    request_id: str
    released: bool = False


#: Engine finish reasons as OpenAI-style APIs name them.
_FINISH_NAMES = {"stop": "stop", "length": "length", "cancelled": "abort"}


def _failure_status(ev: Failed) -> str:
    if ev.retryable:
        return "UNAVAILABLE"
    return "INTERNAL" if ev.message.startswith("internal error") else "INVALID_ARGUMENT"


def _request_stats(finished: Finished) -> RequestStats:
    seq, s = finished.seq, finished.stats
    decode_s = (seq.emit_times[-1] - seq.emit_times[0]) if len(seq.emit_times) > 1 else 0.0
    base = RequestStats(ttft_s=finished.ttft_s, decode_s=decode_s,
                        tokens_per_s=(len(seq.output_ids) - 1) / decode_s if decode_s > 0 else 0.0)
    if s is None or not s.num_rounds:
        return base
    return replace(base, num_rounds=s.num_rounds, mean_tokens_per_round=s.mean_tokens_per_round,
                   acceptance_rate=s.acceptance_rate or 0.0, num_drafted=s.num_drafted, num_accepted=s.num_accepted,
                   num_plain_rounds=s.num_rounds - s.num_drafts, acceptance_by_position=s.acceptance_by_position())


class FrontEnd:
    """Submit, stream, cancel, stats and health over a :class:`VerifierServer`'s engine loop. Safe to call from
    several event loops: each request's events come back on the loop that submitted it."""

    def __init__(self, server: VerifierServer) -> None:
        self.server = server
        #: Requests in flight per client key (submitted, not yet cancelled).
        self.streams_by_client: dict[str, int] = {}
        self._lock = threading.Lock()
        self._tokenize = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="ssd-tokenize")

    # ---- requests ----------------------------------------------------------------------------------------------
    async def submit(self, request: GenerationRequest, caller: Caller) -> Ticket:
        """Validate ``request``, count it against ``caller``'s limits and admit it (GenerationError if refused)."""
        srv, engine_loop = self.server, self.server.engine_loop
        if engine_loop is None:
            raise GenerationError("UNAVAILABLE", "the server is starting")
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(self._tokenize, srv.encode, request.prompt)
            params = request.params
            if request.default_max_new_tokens is not None:
                cap = srv.context_limit - len(ids)
                params = replace(params, max_new_tokens=min(request.default_max_new_tokens, cap))
            srv.check_limits(ids, params)
            self._check_request_limits(ids, params)
            client = caller.key
            self._take_slot(client)
            try:
                seq = engine_loop.new_sequence(ids, params)
                handle = engine_loop.submit(seq, loop)
            except BaseException:
                self._give_slot(client)
                raise
        except QueueFull as exc:
            raise GenerationError("RESOURCE_EXHAUSTED", str(exc)) from None
        except Draining as exc:
            raise GenerationError("UNAVAILABLE", str(exc)) from None
        except ValueError as exc:
            raise GenerationError("INVALID_ARGUMENT", str(exc)) from None
        handle.client, handle.public_id = client, request.request_id or seq.request_id
        return Ticket(handle, client, handle.public_id)

    async def stream(self, ticket: Ticket) -> AsyncIterator[Chunk | Result]:
        """The request's :class:`Chunk` events, then its :class:`Result`; GenerationError if it fails."""
        while True:
            ev = await ticket.handle.events.get()
            if isinstance(ev, Delta):
                yield Chunk(ev.token_ids, ev.text, ev.logprobs,
                            self._token_logprobs(ev.token_ids, ev.logprobs, ev.top_logprobs))
            elif isinstance(ev, Finished):
                yield self._result(ev, ticket.request_id)
                return
            elif isinstance(ev, Failed):
                raise GenerationError(_failure_status(ev), ev.message)

    async def result(self, ticket: Ticket) -> Result:
        """The request's :class:`Result` (its chunks skipped); GenerationError if it fails."""
        async for ev in self.stream(ticket):
            if isinstance(ev, Result):
                return ev
        raise GenerationError("INTERNAL", "the request ended without a result")

    def cancel(self, ticket: Ticket) -> None:
        """End ``ticket``: a request still running is cancelled (KV freed on both sides); the client's slot is given
        back once. Every submitted ticket ends here, finished or not."""
        if ticket.released:
            return
        ticket.released = True
        self._give_slot(ticket.client)
        if not ticket.handle.done:
            self.server.engine_loop.cancel(ticket.handle)

    # ---- stats and health --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return self.server.stats()

    async def healthy(self) -> bool:
        """Serving: started, and neither draining nor stopping."""
        loop = self.server.engine_loop
        return loop is not None and not loop.draining and not self.server.stopping

    # ---- internals ---------------------------------------------------------------------------------------------
    def _check_request_limits(self, ids: list[int], params: SamplingParams) -> None:
        c = self.server.config
        if c.max_prompt_tokens is not None and len(ids) > c.max_prompt_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens; this server allows {c.max_prompt_tokens} per request")
        if c.max_new_tokens_limit is not None and params.max_new_tokens > c.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens {params.max_new_tokens} exceeds this server's limit of "
                             f"{c.max_new_tokens_limit}")

    def _take_slot(self, client: str) -> None:
        limit = self.server.config.max_streams_per_client
        with self._lock:
            held = self.streams_by_client.get(client, 0)
            if limit is not None and held >= limit:
                raise QueueFull(f"this client already has {limit} requests in flight")
            self.streams_by_client[client] = held + 1

    def _give_slot(self, client: str) -> None:
        with self._lock:
            n = self.streams_by_client.get(client, 1) - 1
            if n > 0:
                self.streams_by_client[client] = n
            else:
                self.streams_by_client.pop(client, None)

    def _token_logprobs(self, ids: list[int], logprobs: list[float], top: list) -> list[PositionLogprobs]:
        """Per token: the chosen one and its alternatives, with their text pieces (empty without logprobs)."""
        if not logprobs:
            return []
        piece = self.server.token_piece
        return [PositionLogprobs(TokenLogprob(t, piece(t), lp),
                                 [TokenLogprob(a, piece(a), alp) for a, alp in (top[i] if top else [])])
                for i, (t, lp) in enumerate(zip(ids, logprobs))]

    def _result(self, finished: Finished, request_id: str) -> Result:
        seq = finished.seq
        return Result(request_id=request_id, mode=self.server.config.spec.mode, token_ids=list(seq.output_ids),
                      text=seq.text, finish_reason=_FINISH_NAMES.get(seq.finish_reason or ""),
                      num_prompt_tokens=len(seq.prompt_ids), logprobs=list(seq.output_logprobs),
                      stats=_request_stats(finished),
                      token_logprobs=self._token_logprobs(seq.output_ids, seq.output_logprobs,
                                                          seq.output_top_logprobs))
