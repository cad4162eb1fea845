"""The drafter as its own OS process (local two-process SSD), pinned to its own core, talking over a pipe.

:class:`PipeLink` implements the drafter link (:class:`spec_core.speculation.DrafterLink`), as the gRPC transport
does, and carries the same codec messages. The drafter loop blocks only on the link: it drains every event that has arrived, applies outcomes,
answers misses just in time, then builds the next branch bundles for all requests in one batch.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafter_service.core_borrowing import core_borrowing
from drafter_service.draft_request import drafter_params
from drafter_service.run_ahead import RunAheadDrafter, RunAheadLoop
from drafter_service.ssd_drafter import DraftRequest, SSDDrafter
from protos import codec
from protos.ssd.v1 import ssd_pb2 as pb
from spec_core.arch import decode_params
from spec_core.config import ModelConfig, SSDConfig, resolve_strategy
from spec_core.core_flags import CoreFlags
from spec_core.models import load_runner
from spec_core.ngram import backup_tokens
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from spec_core.speculation import (
    FreeEvent,
    OutcomeEvent,
    PrefillEvent,
    Speculation,
    SpeculationMsg,
)

logger = logging.getLogger(__name__)


class PipeLink:
    """One end of a ``multiprocessing`` pipe carrying ``ssd.v1`` protobuf messages through the codec, as gRPC does.

    The verifier's end (``role="verifier"``) sends ``DrafterEvent``s (the hello first, then prefills, outcomes and
    frees) and receives ``DrafterMessage``s (the ack first, then bundles and just-in-time drafts); the drafter's
    end the reverse. ``vocab_size`` must be set on the verifier's end (it decodes probability rows). Closing an
    end is the stop signal: the other end reads EOF.

    ``send`` never blocks: messages are encoded by the caller and written by this end's writer thread, in order.
    Both loops send and receive; with blocking writes, each side could fill the other's pipe buffer while it is
    itself blocked writing, and neither would ever read again (seen at concurrency 16, sampled, where bundles
    carry probability rows).
    """

    def __init__(self, conn, vocab_size: int | None = None, proc: mp.Process | None = None,
                 role: str = "verifier") -> None:
        """``proc``: the process at the other end, if this end spawned it (then :attr:`alive` watches it)."""
        if role not in ("verifier", "drafter"):
            raise ValueError(f"role must be verifier or drafter, got {role!r}")
        self.conn = conn
        self.vocab_size = vocab_size
        self.proc = proc
        self.role = role
        self.bytes_sent = 0
        self._closed = False  # the other end is gone (EOF or a broken pipe seen)
        self._pending: bytes | None = None
        # A poll(0) through Connection.poll builds a selector each call (about 50 us, every engine step): one
        # registered poll object answers it in a few.
        self._poller = None
        if hasattr(select, "poll"):
            self._poller = select.poll()
            self._poller.register(conn.fileno(), select.POLLIN)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="pipe-writer", daemon=True)
        self._writer.start()

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the other end is gone (shutdown or crash); the reader side reports it
                return

    def send_pb(self, m) -> None:
        """Send one protobuf message (a ``DrafterEvent`` from the verifier, a ``DrafterMessage`` from the drafter)."""
        data = m.SerializeToString()
        self.bytes_sent += len(data)
        self._outbox.put(data)

    def send(self, msg: object) -> None:
        self.send_pb(codec.event_to_pb(msg) if self.role == "verifier" else codec.message_to_pb(msg))

    @property
    def alive(self) -> bool:
        """False once the other end has gone: its process died, or the pipe reached EOF."""
        return not self._closed and (self.proc is None or self.proc.is_alive())

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message is ready; a closed pipe is never ready (it marks the link dead instead)."""
        if self._pending is not None:
            return True
        if self._closed:
            return False
        try:
            if timeout == 0 and self._poller is not None:
                if not self._poller.poll(0):  # readable, hung up or in error: recv_bytes tells which
                    return False
            elif not self.conn.poll(timeout):
                return False
            self._pending = self.conn.recv_bytes()
            return True
        except (EOFError, OSError):
            self._closed = True
            return False

    def recv_pb(self):
        """The next protobuf message (blocking); ``EOFError`` once the other end has gone."""
        if self._pending is None and not self.poll(None):
            raise EOFError("the other end of the pipe has gone")
        data, self._pending = self._pending, None
        return (pb.DrafterMessage if self.role == "verifier" else pb.DrafterEvent).FromString(data)

    def recv(self) -> object:
        """The next typed message (bundles keep the drafter's completion time: same machine, same clock)."""
        m = self.recv_pb()
        if self.role == "verifier":
            return codec.message_from_pb(m, self.vocab_size)
        return codec.event_from_pb(m)

    def flush(self) -> None:
        """Sends are written by the writer thread as they come: nothing to flush."""

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (up to ``timeout_s``), then close (the other end reads EOF)."""
        self._outbox.put(None)
        self._writer.join(timeout_s)
        self.conn.close()


@dataclass(frozen=True, slots=True)
class DrafterProcessConfig:
    draft_path: str
    ssd: SSDConfig
    core: int | None = 1
    dtype: str = "float32"
    device: str = "cpu"
    pad_rows: bool = True  #: :mod:`spec_core.backends.cpu.row_padding`
    cpu_kernels: bool = True  #: :mod:`spec_core.backends.cpu.cpu_kernels`
    #: Run-ahead drafting on a CPU: the verifier's core, borrowed while the verifier waits (None: never).
    lend_core: int | None = None
    #: The draft head's vocabulary (``ModelConfig.head_vocab``; None: auto).
    head_vocab: int | None = None
    #: ``ModelConfig.cuda_graphs``.
    cuda_graphs: bool = True

    def model(self) -> ModelConfig:
        """The draft as a :class:`ModelConfig`: a weight format (``w8a8`` under an int4 target) is a format, not
        only a compute dtype."""
        return ModelConfig(self.draft_path, self.dtype, self.device, self.pad_rows, self.cpu_kernels, self.head_vocab,
                           self.cuda_graphs)


class DrafterLoop:
    """Event handling, separated from the process so it can be unit-tested in one process."""

    def __init__(self, drafter: SSDDrafter, link: PipeLink, backup: str = "ngram", wait_fraction: float = 0.5
                 ) -> None:
        self.drafter = drafter
        self.link = link
        self.backup = backup
        self.wait_fraction = wait_fraction
        self.running = True

    def handle(self, events: list[object]) -> None:
        outcomes: list[OutcomeEvent] = []
        reqs, specs, misses = [], [], []
        for ev in events:
            if isinstance(ev, PrefillEvent):
                self.drafter.add(Sequence(ev.request_id, list(ev.token_ids), drafter_params(ev.params)), ev.k)
                # Round 0 verifies no speculation (the target's prefill): pre-draft for its bonus token already.
                req = self.drafter.requests[ev.request_id]
                req.round = 0
                if req.k > 0:
                    reqs.append(req)
                    specs.append(Speculation([], None, "prefill"))
            elif isinstance(ev, FreeEvent):
                self.drafter.free(ev.request_id)
            elif isinstance(ev, OutcomeEvent):
                outcomes.append(ev)
            elif ev == "stop":
                self.running = False
        misses = self._take_outcomes(outcomes, reqs, specs, misses)
        if outcomes:
            self.drafter.refresh_estimates()
        # A request freed later in this same batch of events (e.g. a cancelled stream) must not get a bundle:
        # building one would allocate KV blocks that nothing frees.
        live = [i for i, r in enumerate(reqs) if self.drafter.requests.get(r.seq.request_id) is r]
        if len(live) < len(reqs):
            reqs, specs = [reqs[i] for i in live], [specs[i] for i in live]
            misses = [live.index(i) for i in misses if i in live]
        if not reqs:
            return
        self._serve_misses(reqs, specs, misses)
        for req, bundle in zip(reqs, self.drafter.build_bundles(reqs, specs, send=self.link.send)):
            req.bundle = bundle

    def _take_outcomes(self, outcomes: list[OutcomeEvent], reqs: list, specs: list, misses: list[int]) -> list[int]:
        """Commit each outcome and queue its request for the next speculation (``reqs``/``specs``, in place; a
        request prefilled in the same batch loses that entry); returns ``misses``, the indices to draft just in
        time."""
        for ev in outcomes:
            req = self.drafter.requests.get(ev.request_id)
            if req is None:
                continue
            bundle = req.bundle
            own = (bundle is not None and bundle.round == ev.round and bundle.base_tokens == ev.verified
                   and bundle.base_parents == ev.parents)
            if ev.node_cost is not None:
                self.drafter.node_cost = ev.node_cost
            if ev.step_s is not None:
                self.drafter.step_s, self.drafter.step_others = ev.step_s, ev.step_others
            if ev.verify_s:
                self.drafter.verify_s = ev.verify_s
            hit = own and ev.key in bundle.entries
            if own:
                self.drafter.observe(req, ev)
            self.drafter.commit_outcome(req, ev.accepted, ev.bonus, ev.spine_accepted if own else 0)
            req.round = ev.round + 1
            req.k = min(ev.next_k, self.drafter.config.k)
            same = [j for j, r in enumerate(reqs) if r is req]
            if same:  # prefilled in this same batch: its round-0 bundle is moot now, and drafting the request
                j = same[0]  # twice in one pass would corrupt its K/V (both entries write its cache)
                del reqs[j], specs[j]
                misses = [m - (m > j) for m in misses]
            if req.k <= 0:
                req.bundle = None
                continue
            reqs.append(req)
            if hit:
                specs.append(bundle.entries[ev.key])
            elif ev.jit and (req.seq.reproducible  # a seeded sampled request: its verifier waits for this draft
                             or self.drafter.jit_s_per_token * req.k < self.wait_fraction * ev.verify_s):
                specs.append(None)
                misses.append(len(reqs) - 1)
            else:  # a just-in-time draft would be late: the verifier will use the backup, so build on it
                specs.append(Speculation(backup_tokens(req.seq.token_ids, req.k, self.backup), None, "backup"))
        return misses

    def _serve_misses(self, reqs: list[DraftRequest], specs: list, misses: list[int]) -> None:
        if not misses:
            return
        jit = self.drafter.draft_jit([reqs[i] for i in misses])
        for i, spec in zip(misses, jit):
            specs[i] = spec
            self.link.send(SpeculationMsg(reqs[i].seq.request_id, reqs[i].round, spec))

    def run(self) -> None:
        """Serve until "stop", or until the verifier's end of the link is gone."""
        while self.running:
            try:
                events = [self.link.recv()]
            except EOFError:
                return
            while self.link.poll(0):
                events.append(self.link.recv())
            self.handle(events)


def load_draft(config: DrafterProcessConfig) -> ModelRunner:
    """The drafter process's runner: the draft in ``config.dtype``, weight formats included (a ``w8a8`` draft
    loaded as fp32 costs 3.1 ms a step instead of 0.8, and SD's in-process draft would outrun it)."""
    return load_runner(config.model(), reference=False)


def drafter_process_main(conn, config: DrafterProcessConfig, flags: CoreFlags | None = None) -> None:
    """Entry point of the drafter process: pin, load, answer the verifier's hello, serve until the pipe closes.
    ``flags``: the cores' shared flags (:mod:`spec_core.core_flags`), for a run-ahead drafter."""
    if config.core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {config.core})
    torch.set_num_threads(1)
    runner = load_draft(config)
    link = PipeLink(conn, role="drafter")
    try:
        first = link.recv_pb()
    except EOFError:
        return
    if first.WhichOneof("event") != "hello":
        raise RuntimeError("the first event on the drafter pipe must be hello")
    backup, wait_fraction = codec.backup_settings(first.hello)
    strategy = drafter_strategy(config.ssd, runner, first.hello.target_params)
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    link.send_pb(pb.DrafterMessage(ack=pb.HelloAck(protocol_version=codec.PROTOCOL_VERSION, pid=os.getpid(),
                                                   model=config.draft_path, device=str(runner.device),
                                                   affinity=affinity, strategy=strategy)))
    if strategy == "run-ahead":
        borrowing = core_borrowing(flags and flags.waiting, config.core, config.lend_core, runner)
        drafter = RunAheadDrafter(runner, config.ssd, alternate=flags and flags.alternate)
        RunAheadLoop(drafter, link, borrowing, idle=flags and flags.idle).run()
    else:
        DrafterLoop(SSDDrafter(runner, config.ssd), link, backup, wait_fraction).run()


def drafter_strategy(ssd: SSDConfig, runner: ModelRunner, target_params: int) -> str:
    """The strategy this drafter runs: ``ssd.strategy``, or for ``auto`` by the share of the target's weights its
    own make (``fanout`` when the verifier did not send the target's)."""
    if ssd.strategy == "auto" and not target_params:
        return "fanout"
    return resolve_strategy(ssd.strategy, decode_params(runner.hf_config), target_params)


def spawn_drafter(config: DrafterProcessConfig, hello: pb.Hello, timeout_s: float = 120.0,
                  flags: CoreFlags | None = None,
                  main: Callable = drafter_process_main) -> tuple[mp.Process, PipeLink, dict]:
    """Start the drafter process, send ``hello`` (with the verifier's backup settings) and wait for its ack;
    returns the process, the verifier's end of the link and the ack as a dict (pid, device, affinity, strategy).
    ``flags``: the cores' shared flags (:mod:`spec_core.core_flags`): a run-ahead drafter borrows
    ``config.lend_core`` while the verifier waits for it, says when it idles, and stops at K on ``alternate``.
    ``main``: the process's entry point (picklable, :func:`drafter_process_main`'s signature)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=main, args=(child, config, flags), daemon=True, name="ssd-drafter")
    proc.start()
    link = PipeLink(parent, vocab_size=hello.vocab_size, proc=proc)
    link.send_pb(pb.DrafterEvent(hello=hello))
    deadline = time.monotonic() + timeout_s
    while not link.poll(0.1):
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"drafter process did not become ready (exit code {proc.exitcode})")
    ack = link.recv_pb().ack
    return proc, link, {"pid": ack.pid, "device": ack.device, "model": ack.model, "affinity": list(ack.affinity),
                        "strategy": ack.strategy or "fanout"}
