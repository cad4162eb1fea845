"""The drafter's gRPC server (``ssd.v1.Drafter``): one verifier session at a time over a bidirectional stream.

Protocol: the verifier opens ``Connect`` and sends ``hello``; the drafter checks the pairing (protocol version,
vocabulary hash, K, budget, sampling mode) and answers ``ack`` or fails the call with FAILED_PRECONDITION. Then
the verifier streams prefill/outcome/free events and the drafter streams branch bundles and just-in-time
speculations. The drafting itself is :class:`drafter_service.process.DrafterLoop`, run on its own thread over a
:class:`QueueLink`; a new session (e.g. a restarted verifier) replaces the old one with fresh drafter state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field, replace

import grpc

from drafter_service.process import DrafterLoop, drafter_strategy
from drafter_service.run_ahead import RunAheadDrafter, RunAheadLoop
from drafter_service.ssd_drafter import SSDDrafter
from protos import codec
from protos.serving import PeekQueue, ServerThread, add_health_and_reflection, set_health
from protos.ssd.v1 import ssd_pb2 as pb
from protos.ssd.v1 import ssd_pb2_grpc
from spec_core.config import ModelConfig, SSDConfig
from spec_core.kv_budget import pool_blocks
from spec_core.runner import ModelRunner

logger = logging.getLogger(__name__)
SERVICE = "ssd.v1.Drafter"


@dataclass(frozen=True, slots=True)
class DrafterServerConfig:
    """The drafter service, composed from its parts: the draft model, the SSD drafter (speculation and its KV
    pool), then the server's own settings."""

    draft: ModelConfig
    ssd: SSDConfig = field(default_factory=SSDConfig)
    #: The KV pool from free device memory (None: ``ssd.num_blocks`` on a CPU; a default fraction on a GPU).
    kv_memory_fraction: float | None = None
    host: str = "127.0.0.1"
    port: int = 0
    hello_timeout_s: float = 30.0
    #: Mutual TLS: our certificate and key, and the CA that signed the verifier's (protos.security.TLSFiles).
    tls: object | None = None
    #: A bearer token every call but health checks must carry, read from this file or environment variable
    #: (the public API's, when the drafter listens beyond loopback: :func:`cluster.launch.link_security`).
    auth_token_file: str | None = None
    auth_token_env: str | None = None


class QueueLink:
    """The drafter's end of one Connect stream (the link interface of :class:`DrafterLoop`).

    ``recv``/``poll`` read events decoded by the stream reader; ``send`` encodes on the drafting thread and hands
    the message to the stream writer on the event loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, outbox: asyncio.Queue) -> None:
        self.loop = loop
        self.outbox = outbox
        self.inbox = PeekQueue()
        self.bytes_sent = 0

    def send(self, msg: object) -> None:
        m = codec.message_to_pb(msg)
        self.bytes_sent += m.ByteSize()
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, m)

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.inbox.poll(timeout)

    def recv(self) -> object:
        return self.inbox.recv()

    def flush(self) -> None:
        """Sends go to the stream writer as they come: nothing to flush."""


class _Session:
    def __init__(self, runner: ModelRunner, config: DrafterServerConfig, loop: asyncio.AbstractEventLoop,
                 hello: pb.Hello) -> None:
        """The backup settings are the verifier's, from its ``hello``; so is the target's size, by which the
        ``auto`` strategy picks run-ahead drafting (:func:`drafter_service.process.drafter_strategy`)."""
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.link = QueueLink(loop, self.outbox)
        backup, wait_fraction = codec.backup_settings(hello)
        self.strategy = drafter_strategy(config.ssd, runner, hello.target_params)
        if self.strategy == "run-ahead":
            self.loop = RunAheadLoop(RunAheadDrafter(runner, config.ssd), self.link)
        else:
            self.loop = DrafterLoop(SSDDrafter(runner, config.ssd), self.link, backup=backup,
                                    wait_fraction=wait_fraction)
        self.thread = threading.Thread(target=self._run, args=(loop,), name="drafter-loop", daemon=True)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.loop.run()
        except Exception:  # noqa: BLE001 - the session ends; the verifier falls back to its backup
            logger.exception("drafter loop failed")
        finally:
            try:
                loop.call_soon_threadsafe(self.outbox.put_nowait, None)  # ends the stream writer
            except RuntimeError:  # the server's event loop is already closed: nothing left to end
                pass

    def stop(self) -> None:
        self.link.inbox.put("stop")


class DrafterServicer(ssd_pb2_grpc.DrafterServicer):
    def __init__(self, runner: ModelRunner, config: DrafterServerConfig, vocab_hash: str) -> None:
        self.runner = runner
        ssd = config.ssd
        gpu = runner.device.type == "cuda"
        if config.kv_memory_fraction is not None or gpu:
            blocks = pool_blocks(None, config.kv_memory_fraction, runner.kv_bytes_per_token(), ssd.block_size,
                                 runner.device, ssd.num_blocks)
            config = replace(config, ssd=replace(ssd, num_blocks=blocks))
            logger.info("drafter KV pool: %d blocks of %d tokens", blocks, ssd.block_size)
        self.config = config
        self.expected = codec.make_hello(vocab_hash, runner.vocab_size, ssd.k, ssd.fanout.budget,
                                         codec.sampling_mode(ssd.saguaro_c, ssd.fanout.kind, ssd.tree))
        self.session: _Session | None = None
        self.sessions_started = 0

    async def _replace_session(self, hello: pb.Hello) -> _Session:
        old = self.session
        if old is not None:
            old.stop()
            await asyncio.to_thread(old.thread.join, 10.0)
        session = _Session(self.runner, self.config, asyncio.get_running_loop(), hello)
        self.session = session
        self.sessions_started += 1
        session.thread.start()
        return session

    async def Connect(self, request_iterator, context):  # noqa: N802 - gRPC method name
        it = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(it.__anext__(), self.config.hello_timeout_s)
        except (StopAsyncIteration, TimeoutError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Connect must start with a hello event")
        if first.WhichOneof("event") != "hello":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the first event on Connect must be hello")
        problems = codec.hello_mismatch(first.hello, self.expected)
        try:
            codec.backup_settings(first.hello)
        except ValueError as exc:
            problems.append(str(exc))
        if problems:
            logger.warning("refused a verifier: %s", "; ".join(problems))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "drafter/verifier mismatch: " + "; ".join(problems))
        session = await self._replace_session(first.hello)
        yield pb.DrafterMessage(ack=pb.HelloAck(protocol_version=codec.PROTOCOL_VERSION, pid=os.getpid(),
                                                model=self.config.draft.path, device=str(self.runner.device),
                                                strategy=session.strategy))
        reader = asyncio.create_task(self._read(it, session))
        try:
            while True:
                msg = await session.outbox.get()
                if msg is None:
                    break
                yield msg
        finally:
            reader.cancel()
            session.stop()

    async def _read(self, it, session: _Session) -> None:
        try:
            async for event in it:
                try:
                    session.link.inbox.put(codec.event_from_pb(event))
                except ValueError as exc:
                    logger.warning("dropping a malformed drafter event: %s", exc)
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        finally:
            session.stop()


class DrafterServer:
    """Loads the draft model and serves ``ssd.v1.Drafter`` (plus health and reflection) on its own thread."""

    def __init__(self, config: DrafterServerConfig) -> None:
        from spec_core.model_paths import check_model_dir
        from spec_core.models import load_runner, load_tokenizer, vocab_hash

        self.config = config
        path = check_model_dir(config.draft.path)
        self.runner = load_runner(config.draft, reference=False)  # a weight format too (w8a8 under an int4 target)
        self.vocab_hash = vocab_hash(load_tokenizer(path))
        self.servicer = DrafterServicer(self.runner, config, self.vocab_hash)
        self.thread: ServerThread | None = None
        self.address: str | None = None

    def start(self) -> str:
        async def setup(server: grpc.aio.Server) -> None:
            ssd_pb2_grpc.add_DrafterServicer_to_server(self.servicer, server)
            hs = add_health_and_reflection(server, [SERVICE])
            await set_health(hs, [SERVICE], serving=True)

        from protos.security import BearerTokenInterceptor, is_loopback, read_secret

        c = self.config
        token = read_secret(c.auth_token_file, c.auth_token_env)
        creds = c.tls.server_credentials() if c.tls is not None else None
        if not is_loopback(c.host) and creds is None and token is None:
            logger.warning("the drafter link on %s has neither TLS nor a token", c.host)
        self.thread = ServerThread(f"{c.host}:{c.port}", setup, name="drafter-grpc", credentials=creds,
                                   interceptors=[BearerTokenInterceptor(token)] if token else [])
        port = self.thread.start()
        self.address = f"{self.config.host}:{port}"
        logger.info("drafter serving %s on %s", SERVICE, self.address)
        return self.address

    def stop(self, grace_s: float = 5.0) -> None:
        if self.servicer.session is not None:
            self.servicer.session.stop()
        if self.thread is not None:
            self.thread.stop(grace_s)
