"""gRPC plumbing shared by the drafter and verifier servers and their clients.

* explicit message-size limits and keepalive on every server and channel; retries through the channel's service
  config (:func:`retry_service_config`);
* health checking (``grpc.health.v1``) and server reflection on every server;
* :class:`ServerThread`: a ``grpc.aio`` server on its own event-loop thread, so a Ray actor (or any blocking
  program) can host one and stop it gracefully.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)

#: 64 MiB: a bundle for a large batch of sampled requests carries float32 probability rows.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Default deadline (seconds) for unary calls made by our clients.
DEFAULT_DEADLINE_S = 600.0
#: gRPC's cap on ``retryPolicy.maxAttempts`` (the first try included); larger values are clamped by gRPC.
MAX_RETRY_ATTEMPTS = 5

_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        # never answer a client's keepalive pings with GOAWAY "too_many_pings" (seen with many channels to one
        # server: in-flight streams would end UNAVAILABLE)
        ("grpc.http2.max_ping_strikes", 0),
        *_KEEPALIVE,
    ]


def channel_options(service_config: str | None = None,
                    max_reconnect_backoff_s: float | None = None) -> list[tuple[str, int | str]]:
    """Options for every client channel. ``service_config``: a JSON service config (e.g.
    :func:`retry_service_config`), which also turns retries on; ``max_reconnect_backoff_s`` caps how long a channel
    waits between reconnection attempts to a server that went away (gRPC's default grows to 120 s)."""
    opts: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        *_KEEPALIVE,
    ]
    if service_config is not None:
        opts += [("grpc.enable_retries", 1), ("grpc.service_config", service_config)]
    if max_reconnect_backoff_s is not None:
        opts.append(("grpc.max_reconnect_backoff_ms", max(100, int(max_reconnect_backoff_s * 1000))))
    return opts


def retry_service_config(max_attempts: int, initial_backoff_s: float, max_backoff_s: float,
                         multiplier: float = 2.0, service: str = "ssd.v1.Generation") -> str:
    """A gRPC service config (JSON) whose ``retryPolicy`` retries every method of ``service`` on UNAVAILABLE.

    Invariants (gRFC A6, implemented by gRPC itself): ``max_attempts`` counts the first try and is at most
    :data:`MAX_RETRY_ATTEMPTS`; attempt ``n`` waits ``initial_backoff_s * multiplier**(n-1)``, capped at
    ``max_backoff_s``, with jitter; a call is committed, and never retried, once any response (headers or a
    message) has arrived, so a stream is retried only before its first token and never repeats one; a request
    larger than the retry buffer (``grpc.per_rpc_retry_buffer_size``, 256 KiB by default) is not retried.
    """
    if not 2 <= max_attempts <= MAX_RETRY_ATTEMPTS:
        raise ValueError(f"max_attempts must be in [2, {MAX_RETRY_ATTEMPTS}], got {max_attempts}")
    if not 0.001 <= initial_backoff_s <= max_backoff_s or multiplier <= 0:
        raise ValueError("backoffs must satisfy 0.001 s <= initial <= max, and the multiplier must be > 0")
    policy = {
        "maxAttempts": max_attempts,
        "initialBackoff": f"{initial_backoff_s:.3f}s",
        "maxBackoff": f"{max_backoff_s:.3f}s",
        "backoffMultiplier": multiplier,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    return json.dumps({"methodConfig": [{"name": [{"service": service}], "retryPolicy": policy}]})


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Register health (every service starts NOT_SERVING) and reflection for ``service_names``."""
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return hs


async def set_health(hs: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await hs.set(name, status)


class ServerThread:
    """Runs ``setup(server) -> awaitable`` on a fresh ``grpc.aio`` server in a daemon thread with its own loop.

    ``start()`` returns the bound port once the server is listening. ``call(coro_fn)`` runs a coroutine on the
    server's loop from any thread. ``stop(grace)`` stops accepting calls, lets in-flight calls finish for up to
    ``grace`` seconds, then ends the thread.
    """

    def __init__(self, bind: str, setup: Callable[[grpc.aio.Server], Awaitable[None]],
                 maximum_concurrent_rpcs: int | None = None, name: str = "grpc-server",
                 interceptors: list | None = None, credentials: grpc.ServerCredentials | None = None) -> None:
        """``credentials``: TLS (see :mod:`protos.security`); ``interceptors``: e.g. bearer-token auth."""
        self.bind = bind
        self.interceptors = interceptors or []
        self.credentials = credentials
        self.setup = setup
        self.maximum_concurrent_rpcs = maximum_concurrent_rpcs
        self.loop = asyncio.new_event_loop()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stopped: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self, timeout_s: float = 60.0) -> int:
        self.thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"gRPC server on {self.bind} did not start within {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"gRPC server on {self.bind} failed to start: {self._error}") from self._error
        assert self.port is not None
        return self.port

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        try:
            self.server = grpc.aio.server(options=server_options(), interceptors=self.interceptors,
                                          maximum_concurrent_rpcs=self.maximum_concurrent_rpcs)
            await self.setup(self.server)
            if self.credentials is not None:
                self.port = self.server.add_secure_port(self.bind, self.credentials)
            else:
                self.port = self.server.add_insecure_port(self.bind)
            if not self.port:
                raise OSError(f"cannot bind {self.bind}")
            await self.server.start()
        except BaseException as exc:  # reported to start()'s caller
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._stopped.wait()

    def call(self, coro_fn: Callable[[], Awaitable], timeout_s: float | None = None):
        """Run ``coro_fn()`` on the server loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout_s)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.server is None or not self.thread.is_alive():
            return

        async def _stop() -> None:
            await self.server.stop(grace_s)
            self._stopped.set()

        try:
            self.call(_stop, timeout_s=grace_s + 10)
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.exception("error while stopping the gRPC server on %s", self.bind)
        self.thread.join(timeout=5)


class PeekQueue:
    """A thread-safe inbox with the link interface's ``poll(timeout)`` / ``recv()`` (poll keeps what it saw)."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()
        self._peek: object | None = None

    def put(self, item: object) -> None:
        self.queue.put(item)

    def empty(self) -> bool:
        return self._peek is None and self.queue.empty()

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self._peek is None:
            try:
                self._peek = self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
            except queue.Empty:
                return False
        return True

    def recv(self) -> object:
        if self._peek is not None:
            item, self._peek = self._peek, None
            return item
        return self.queue.get()
