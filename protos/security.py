"""Optional transport security and authentication for the gRPC servers.

* TLS: a server certificate for the public API; mutual TLS between drafter and verifier (each side presents a
  certificate signed by the shared CA, and checks the other's).
* Bearer tokens on the public API: every call but health checks and reflection must carry
  ``authorization: Bearer <token>``; otherwise UNAUTHENTICATED.

Secrets are read from files (or an environment variable naming the token) and never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def is_loopback(host: str) -> bool:
    """Whether a bind host is reachable only from its own machine ("localhost" or a loopback address)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def read_secret(path: str | None = None, env: str | None = None) -> str | None:
    """A secret from a file (stripped) or from the environment variable ``env``; None if neither is set."""
    if path:
        value = Path(path).read_text(encoding="utf-8").strip()
        if not value:
            raise ValueError(f"secret file {path} is empty")
        return value
    if env:
        return os.environ.get(env) or None
    return None


@dataclass(frozen=True, slots=True)
class TLSFiles:
    cert: str
    key: str
    ca: str | None = None  # set: require and verify client certificates (mutual TLS)

    def server_credentials(self) -> grpc.ServerCredentials:
        pair = [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())]
        ca = Path(self.ca).read_bytes() if self.ca else None
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side of mutual TLS: trust ``ca`` and present our own certificate."""
        ca = Path(self.ca).read_bytes() if self.ca else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=Path(self.key).read_bytes(),
                                            certificate_chain=Path(self.cert).read_bytes())


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the right bearer token (constant-time comparison)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHODS):
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._expected):
                    return await continuation(handler_call_details)
        return self._deny_unary
