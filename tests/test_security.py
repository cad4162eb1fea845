"""TLS on the public API, mutual TLS between drafter and verifier, bearer tokens; secrets never logged."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import grpc
import pytest

from drafter_service.server import DrafterServer, DrafterServerConfig
from protos.security import TLSFiles
from spec_core.config import ModelConfig, SamplingParams, SpeculationConfig, SSDConfig
from verifier_service.client import SSDClient
from verifier_service.drafter_link import GrpcDrafterLink, HandshakeError
from verifier_service.server import VerifierServer, VerifierServerConfig

TOKEN = "s3cr3t-token-do-not-log"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost, and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=ssd-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", "san.cnf", cwd=d)
    (d / "token").write_text(TOKEN + "\n")
    return d


def test_tls_and_bearer_token(toy_pair, pki, caplog, greedy_reference) -> None:
    caplog.set_level(logging.DEBUG)
    server = VerifierServer(VerifierServerConfig(ModelConfig(toy_pair["target"]), spec=SpeculationConfig("ar", 0),
                                                 auth_token_file=str(pki / "token"),
                                                 tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key")))
    address = server.start()
    try:
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        for token in (None, "wrong"):
            with SSDClient(address, tls_ca=str(pki / "ca.pem"), token=token, retries=0) as client:
                with pytest.raises(grpc.RpcError) as info:
                    client.complete("def f():", params)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert client.health() == "SERVING"  # probes need no token
                with pytest.raises(grpc.RpcError) as info:
                    list(client.generate("def f():", params))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with SSDClient(address, tls_ca=str(pki / "ca.pem"), token=TOKEN) as client:
            assert list(client.complete("def f():", params).token_ids) == greedy_reference("def f():", 8)
        with SSDClient(address, token=TOKEN, retries=0) as plain:  # plaintext to a TLS port fails
            with pytest.raises(grpc.RpcError):
                plain.stub.Complete(plain_request(), timeout=5, metadata=plain.metadata)
    finally:
        server.stop()
    assert TOKEN not in caplog.text


def plain_request():
    from protos.ssd.v1 import ssd_pb2 as pb

    return pb.GenerateRequest(prompt="x", max_new_tokens=1)


def test_mutual_tls_between_drafter_and_verifier(toy_pair, pki, greedy_reference) -> None:
    drafter_tls = TLSFiles(str(pki / "server.pem"), str(pki / "server.key"), ca=str(pki / "ca.pem"))
    drafter = DrafterServer(DrafterServerConfig(ModelConfig(toy_pair["draft"]), SSDConfig(k=2), tls=drafter_tls))
    drafter.start()
    try:
        client_tls = TLSFiles(str(pki / "client.pem"), str(pki / "client.key"), ca=str(pki / "ca.pem"))
        server = VerifierServer(VerifierServerConfig(ModelConfig(toy_pair["target"]), spec=SpeculationConfig(k=2),
                                                     internal_tls=client_tls))
        address = server.start(drafter.address)
        try:
            with SSDClient(address) as client:
                res = client.complete("def f():", SamplingParams(max_new_tokens=12, ignore_eos=True))
            assert list(res.token_ids) == greedy_reference("def f():", 12)
            assert server.stats()["drafter_connected"]
        finally:
            server.stop()
        # without a client certificate the drafter refuses the connection
        hello = drafter.servicer.expected
        with pytest.raises(HandshakeError):
            GrpcDrafterLink(drafter.address, hello, hello.vocab_size, connect_timeout_s=5)
    finally:
        drafter.stop()


def test_per_client_limits(toy_pair) -> None:
    server = VerifierServer(VerifierServerConfig(ModelConfig(toy_pair["target"]), spec=SpeculationConfig("ar", 0), max_prompt_tokens=20,
                                                 max_new_tokens_limit=50, max_streams_per_client=2))
    address = server.start()
    try:
        with SSDClient(address, retries=0) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.complete("word " * 40, SamplingParams(max_new_tokens=4))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "allows 20" in info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                client.complete("x", SamplingParams(max_new_tokens=51))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit of 50" in info.value.details()
            streams = [client.generate("x", SamplingParams(max_new_tokens=50, ignore_eos=True)) for _ in range(2)]
            for st in streams:
                next(st)
            with pytest.raises(grpc.RpcError) as info:
                client.complete("x", SamplingParams(max_new_tokens=2))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in info.value.details()
            for st in streams:
                st.close()
            import time

            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and server.stats()["admitted"]:
                time.sleep(0.05)
            time.sleep(0.2)
            assert client.complete("x", SamplingParams(max_new_tokens=2)).token_ids
    finally:
        server.stop()
