"""The verifier service core: one :class:`VerifierEngine` stepped on its own thread, fed by many async clients.

Thread model: the front end (:mod:`verifier_service.frontend`, called by the gRPC and HTTP handlers) runs on an
asyncio loop; the engine (and the model forward) runs on one engine thread. The front end calls ``submit`` and
``cancel`` (thread-safe); after every step the engine thread pushes each request's new tokens to that request's
asyncio queue, on the loop it was submitted from, as :class:`Delta` events, then one :class:`Finished` event. The stream of
deltas of a request concatenates exactly to its final token ids and text (tested).

Admission: at most ``max_queue`` requests are admitted (running + waiting); beyond that ``submit`` raises
:class:`QueueFull` (RESOURCE_EXHAUSTED). While draining, ``submit`` raises :class:`Draining` (UNAVAILABLE).
A cancelled request is removed from the scheduler, its KV blocks freed, and the drafter told to free its own.
:meth:`EngineLoop.shed` ends every admitted request with a retryable :class:`Failed` (a drain's grace ran out), so
that no handler is left waiting when the servers stop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from spec_core.config import SamplingParams
from spec_core.detokenizer import IncrementalDetokenizer
from spec_core.sequence import Sequence
from verifier_service.engine import VerifierEngine

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    pass


class Draining(RuntimeError):
    pass


@dataclass(slots=True)
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    #: Per token, its ``top_logprobs`` alternatives as (id, log-probability), when the request asked for them.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(slots=True)
class Finished:
    seq: Sequence
    stats: object
    ttft_s: float


@dataclass(slots=True)
class Failed:
    message: str
    #: The request did nothing wrong (the server is going away): the caller may retry elsewhere (UNAVAILABLE).
    retryable: bool = False


@dataclass(slots=True)
class Handle:
    """A submitted request, as seen by the front end."""

    seq: Sequence
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted_at: float = field(default_factory=time.perf_counter)
    sent_tokens: int = 0
    sent_chars: int = 0
    done: bool = False
    client: str = ""
    #: The id its caller knows it by (the engine's own is assigned by the server).
    public_id: str = ""

    def push(self, event: object) -> None:
        """Hand ``event`` to the handler's loop; a loop already closed (the server stopped) has nobody to tell."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            logger.debug("request %s: its server loop is closed", self.seq.request_id)


class EngineLoop:
    def __init__(self, engine: VerifierEngine, tokenizer, eos_ids: tuple[int, ...], max_queue: int = 64,
                 metrics=None) -> None:
        """``metrics``: an optional :class:`verifier_service.metrics.ServiceMetrics` to observe latencies into."""
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_queue = max_queue
        self.active: dict[str, Handle] = {}
        self._incoming: deque[Handle] = deque()
        self._cancels: deque[Handle] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.draining = False
        self.started_at = time.time()
        self._ids = itertools.count()
        self.thread = threading.Thread(target=self._run, name="verifier-engine", daemon=True)
        self.failures = 0
        #: A new drafter link handed over by another thread; swapped in by the engine thread between steps.
        self.pending_link = None
        self._shed: str | None = None

    # ---- called from handlers (any thread) -------------------------------------------------------------------
    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "") -> Sequence:
        rid = request_id or f"req-{next(self._ids)}"
        return Sequence(rid, list(prompt_ids), params, eos_ids=self.eos_ids,
                        max_len=self.engine.backend.max_positions,
                        detokenizer=IncrementalDetokenizer(self.tokenizer))

    def submit(self, seq: Sequence, loop: asyncio.AbstractEventLoop) -> Handle:
        handle = Handle(seq, loop)
        with self._lock:
            if self.draining:
                raise Draining("the server is draining; retry on another replica")
            if self.num_admitted >= self.max_queue:
                raise QueueFull(f"queue full ({self.max_queue} requests admitted); retry later")
            if seq.request_id in self.active or any(h.seq.request_id == seq.request_id for h in self._incoming):
                raise ValueError(f"request_id {seq.request_id!r} is already in flight")
            self._incoming.append(handle)
        self._wake.set()
        return handle

    def cancel(self, handle: Handle) -> None:
        with self._lock:
            self._cancels.append(handle)
        self._wake.set()

    @property
    def num_admitted(self) -> int:
        return len(self.active) + len(self._incoming)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=10)

    def shed(self, message: str, timeout_s: float = 5.0) -> bool:
        """End every admitted request with a retryable :class:`Failed` (done by the engine thread between steps);
        waits up to ``timeout_s`` for none to be admitted. True if none is."""
        with self._lock:
            self._shed = message
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while self.num_admitted and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.02)
        return self.num_admitted == 0

    def drain(self, timeout_s: float) -> bool:
        """Refuse new requests; wait up to ``timeout_s`` for admitted ones to finish. True if all finished."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.num_admitted and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.num_admitted == 0

    # ---- engine thread ---------------------------------------------------------------------------------------
    def _swap_link(self) -> None:
        new, self.pending_link = self.pending_link, None
        old = getattr(self.engine.drafter, "link", None)
        self.engine.drafter.replace_link(new)
        if old is not None and old is not new:
            old.close()
        logger.info("drafter link replaced (reconnect %d)", self.engine.drafter.reconnects)

    def _run(self) -> None:
        while not self._stop:
            if self.pending_link is not None:
                self._swap_link()
            self._admit()
            if self._shed is not None:
                self._end_all(Failed(self._shed, retryable=True))
            if self.engine.has_work():
                m = self.engine.metrics
                f0, d0 = m.forward_s, m.draft_s
                try:
                    self.engine.step()
                except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
                    logger.exception("engine step failed")
                    self._fail_all(f"internal error in the verifier: {exc}")
                    continue
                if self.metrics is not None:
                    self.metrics.observe_step(m.forward_s - f0, m.draft_s - d0, m.last_step_crossings)
                self._publish()
            else:
                self._wake.wait(0.05)
                self._wake.clear()

    def _admit(self) -> None:
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            cancels, self._cancels = list(self._cancels), deque()
        for h in incoming:
            self.active[h.seq.request_id] = h
            h.submitted_at = time.perf_counter()
            try:
                self.engine.add(h.seq)
            except ValueError as exc:
                self._end(h, Failed(str(exc)))
        for h in cancels:
            if self.active.get(h.seq.request_id) is h and not h.done:
                self.engine.cancel(h.seq)
                if self.metrics is not None:
                    self.metrics.observe_request(h.seq.emit_times, h.submitted_at, "cancelled", len(h.seq.prompt_ids))
                h.done = True
                del self.active[h.seq.request_id]

    def _publish(self) -> None:
        for h in list(self.active.values()):
            seq = h.seq
            n = len(seq.output_ids)
            text = self._safe_text(seq)
            if n > h.sent_tokens or len(text) > h.sent_chars:
                if h.sent_tokens == 0 and n and self.metrics is not None:  # its first token: prefill done
                    self.metrics.observe_first_token(len(seq.prompt_ids), seq.emit_times[0] - h.submitted_at)
                h.push(Delta(seq.output_ids[h.sent_tokens:n], text[h.sent_chars:],
                             seq.output_logprobs[h.sent_tokens:n] if seq.params.logprobs else [],
                             seq.output_top_logprobs[h.sent_tokens:n] if seq.params.top_logprobs else []))
                h.sent_tokens, h.sent_chars = n, len(text)
            if seq.finished:
                stats = seq.stats
                ttft = (seq.emit_times[0] - h.submitted_at) if seq.emit_times else 0.0
                if self.metrics is not None:
                    self.metrics.observe_request(seq.emit_times, h.submitted_at, seq.finish_reason,
                                                 len(seq.prompt_ids))
                self._end(h, Finished(seq, stats, ttft))

    @staticmethod
    def _safe_text(seq: Sequence) -> str:
        """Text that can be streamed now: all of it once finished; otherwise hold back a possible stop-string
        prefix (the last ``len(longest stop) - 1`` characters)."""
        if seq.finished or not seq.params.stop:
            return seq.text
        text = seq.text
        hold = max(len(s) for s in seq.params.stop) - 1
        return text[: max(0, len(text) - hold)]

    def _end(self, h: Handle, event: object) -> None:
        h.done = True
        self.active.pop(h.seq.request_id, None)
        h.push(event)

    def _fail_all(self, message: str) -> None:
        self.failures += 1
        self._end_all(Failed(message))

    def _end_all(self, event: Failed) -> None:
        for h in list(self.active.values()):
            if not h.seq.finished:
                self.engine.cancel(h.seq)
            self._end(h, event)
