"""The verifier's end of the drafter connection over gRPC (``ssd.v1.Drafter/Connect``).

Implements the link interface :class:`verifier_service.ssd_proposer.SSDProposer` uses (``send``, ``poll``,
``recv``) over one bidirectional stream. A reader thread decodes the drafter's messages as they arrive and stamps
each bundle with its *arrival* time on the verifier's clock: a round counts as a hit only if its branch had
arrived here before the previous verification returned.

If the stream breaks (the drafter died), ``alive`` turns False: sends are dropped and the proposer stops waiting,
so every later round uses the backup speculator. Nothing the verifier emits depends on the drafter, so output
stays exact.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from protos import codec
from protos.security import bearer_metadata
from protos.serving import PeekQueue, channel_options
from protos.ssd.v1 import ssd_pb2 as pb
from protos.ssd.v1 import ssd_pb2_grpc
from spec_core.speculation import BranchBundle

logger = logging.getLogger(__name__)


class HandshakeError(RuntimeError):
    """The drafter refused the pairing (FAILED_PRECONDITION) or did not answer the hello in time."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class GrpcDrafterLink:
    """The verifier's end of a drafter ``Connect`` stream (a :class:`spec_core.speculation.DrafterLink`)."""

    def __init__(self, address: str, hello: pb.Hello, vocab_size: int, connect_timeout_s: float = 60.0,
                 session_timeout_s: float = 7 * 24 * 3600.0, tls=None, token: str | None = None) -> None:
        """Connect, send ``hello`` and wait for the drafter's ack (raises :class:`HandshakeError`).
        ``tls``: :class:`protos.security.TLSFiles` for mutual TLS (None: plaintext); ``token``: the bearer token
        the drafter requires (None: none)."""
        self.address = address
        self.vocab_size = vocab_size
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_received = 0
        self.alive = False
        self.error: str | None = None
        self.ack: pb.HelloAck | None = None
        self._out: queue.Queue = queue.Queue()
        self._in = PeekQueue()
        self._acked = threading.Event()
        self.channel = (grpc.secure_channel(address, tls.channel_credentials(), options=channel_options())
                        if tls is not None else grpc.insecure_channel(address, options=channel_options()))
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise HandshakeError(f"drafter at {address} is not reachable", grpc.StatusCode.UNAVAILABLE) from None
        stub = ssd_pb2_grpc.DrafterStub(self.channel)
        self._out.put(pb.DrafterEvent(hello=hello))
        # A long-lived stream: its deadline is the session limit; keepalive pings detect a dead peer sooner.
        self._call = stub.Connect(self._requests(), timeout=session_timeout_s, metadata=bearer_metadata(token))
        self._reader = threading.Thread(target=self._read, name="drafter-link-reader", daemon=True)
        self._reader.start()
        if not self._acked.wait(connect_timeout_s) or self.ack is None:
            self.close()
            code = getattr(self, "_code", None)
            raise HandshakeError(self.error or f"drafter at {address} did not acknowledge the hello", code)

    def _requests(self):
        while True:
            ev = self._out.get()
            if ev is None:
                return
            yield ev

    def _read(self) -> None:
        try:
            for m in self._call:
                if m.WhichOneof("msg") == "ack":
                    self.ack, self.alive = m.ack, True
                    self._acked.set()
                    continue
                self.bytes_received += m.ByteSize()
                self.messages_received += 1
                msg = codec.message_from_pb(m, self.vocab_size)
                if isinstance(msg, BranchBundle):
                    msg.ready_at = time.perf_counter()
                self._in.put(msg)
        except grpc.RpcError as exc:
            self._code = exc.code()
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = f"{exc.code().name}: {exc.details()}"
                logger.warning("drafter stream ended: %s", self.error)
        except ValueError as exc:
            self.error = f"malformed drafter message: {exc}"
            logger.error("%s", self.error)
        finally:
            self.alive = False
            self._acked.set()

    # ---- link interface -------------------------------------------------------------------------------------
    def send(self, msg: object) -> None:
        if not self.alive:
            return
        m = codec.event_to_pb(msg)
        self.bytes_sent += m.ByteSize()
        self._out.put(m)

    def poll(self, timeout: float | None = 0.0) -> bool:
        if not self.alive and self._in.empty():
            return False
        return self._in.poll(timeout)

    def recv(self) -> object:
        return self._in.recv()

    def flush(self) -> None:
        """Each send is queued for the stream writer at once: nothing to flush."""

    def close(self) -> None:
        self._out.put(None)
        try:
            self._call.cancel()
        except Exception:  # noqa: BLE001
            pass
        self.channel.close()
