"""The pair on two Ray nodes of one machine (``ray.cluster_utils.Cluster``, one CPU each).

- STRICT_SPREAD places the drafter and the verifier on different nodes, so the drafter listens on its node IP and
  the link takes the public API's TLS certificate and bearer token (:func:`cluster.launch.link_security`).
- Greedy output through the service equals the target's own greedy output.
- The link refuses a wrong token and plaintext.
- A killed drafter is restarted by Ray in its bundle, so on its node; the verifier reconnects and stays exact.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import ray

from protos import codec
from protos.security import TLSFiles
from spec_core.config import SamplingParams
from verifier_service.client import SSDClient

logger = logging.getLogger(__name__)

TOKEN = "two-nodes-token"
PROMPTS = ["def parse_args(argv):\n    ", "class Cache:\n    def get(self, key):\n        "]
N_TOKENS = 24


@pytest.fixture(scope="module")
def two_nodes():
    """A head and one worker node, one CPU each; the driver connects to it. Any Ray this process already runs
    is shut down first (one driver connection per process), and Ray and the cluster are torn down after."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        logger.warning("shutting down the running Ray to connect to a two-node cluster")
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0,
                                                            "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, num_gpus=0)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def link_pki(two_nodes, tmp_path_factory) -> Path:
    """A self-signed certificate naming the node IP and loopback (the link's and the public API's), and a token."""
    d = tmp_path_factory.mktemp("link-pki")
    ip = ray.util.get_node_ip_address()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "1", "-subj", "/CN=ssd-link",
                    "-addext", f"subjectAltName=IP:{ip},IP:127.0.0.1,DNS:localhost"],
                   cwd=d, check=True, capture_output=True)
    (d / "token").write_text(TOKEN + "\n")
    return d


@pytest.fixture(scope="module")
def spread(two_nodes, link_pki, real_pair):
    """The default pair launched STRICT_SPREAD with TLS and a token on the public API (so on the link too)."""
    from cluster.launch import LaunchOptions, launch
    from spec_core.settings import ServiceConfig

    public = {"tls_cert": str(link_pki / "cert.pem"), "tls_key": str(link_pki / "key.pem"),
              "auth_token_file": str(link_pki / "token")}
    dep = launch(ServiceConfig(target=real_pair["target"], draft=real_pair["draft"], port=0, dtype="float32",
                               gpu="no", strategy="STRICT_SPREAD", **public),
                 options=LaunchOptions(placement_timeout_s=30, start_timeout_s=120))
    yield dep
    dep.shutdown(grace_s=5)


def _client(dep, pki: Path, token: str | None = TOKEN) -> SSDClient:
    return SSDClient(dep.address, tls_ca=str(pki / "cert.pem"), token=token, retries=0)


def _complete_exact(dep, pki: Path, reference) -> None:
    with _client(dep, pki) as client:
        for prompt in PROMPTS:
            res = client.complete(prompt, SamplingParams(max_new_tokens=N_TOKENS, ignore_eos=True))
            assert list(res.token_ids) == reference(prompt, N_TOKENS), prompt


def _stats(dep, pki: Path) -> dict:
    with _client(dep, pki) as client:
        return codec.stats_from_pb(client.stats())


def test_strict_spread_places_the_pair_on_two_nodes(spread) -> None:
    info = spread.info()
    d, v = info["drafter"], info["verifier"]
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(alive) == 2 and {d["node_id"], v["node_id"]} == alive
    table = ray.util.placement_group_table(spread.pg)
    assert table["state"] == "CREATED" and table["strategy"] == "STRICT_SPREAD"
    assert list(table["bundles_to_node_id"].values()) == [d["node_id"], v["node_id"]]
    assert spread.drafter_address.rsplit(":", 1)[0] == d["node_ip"]  # beyond loopback


def test_greedy_output_over_the_secured_link_equals_the_target(spread, link_pki, real_reference) -> None:
    _complete_exact(spread, link_pki, real_reference)
    s = _stats(spread, link_pki)
    assert s["drafter_connected"] and s["ssd_rounds"] > 0, s
    assert spread.info()["drafter"]["sessions"] >= 1


def test_the_link_and_the_api_refuse_a_wrong_token_and_plaintext(spread, link_pki) -> None:
    from protos.ssd.v1 import ssd_pb2 as pb
    from verifier_service.drafter_link import GrpcDrafterLink, HandshakeError

    cert, key = str(link_pki / "cert.pem"), str(link_pki / "key.pem")
    with pytest.raises(HandshakeError) as info:
        GrpcDrafterLink(spread.drafter_address, pb.Hello(), 1, connect_timeout_s=5,
                        tls=TLSFiles(cert, key, ca=cert), token="wrong")
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(HandshakeError):
        GrpcDrafterLink(spread.drafter_address, pb.Hello(), 1, connect_timeout_s=3, token=TOKEN)
    with _client(spread, link_pki, token="wrong") as client:
        with pytest.raises(grpc.RpcError) as err:
            client.complete(PROMPTS[0], SamplingParams(max_new_tokens=2))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_killed_drafter_is_replaced_on_its_node(spread, link_pki, real_reference) -> None:
    before = ray.get(spread.drafter.info.remote(), timeout=30)
    reconnects = _stats(spread, link_pki)["drafter_reconnects"]
    ray.kill(spread.drafter, no_restart=False)  # the process dies; Ray restarts the actor in its bundle
    _complete_exact(spread, link_pki, real_reference)  # served by the backup meanwhile, still exact
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        s = _stats(spread, link_pki)
        if s["drafter_reconnects"] > reconnects and s["drafter_connected"]:
            break
        time.sleep(0.5)
    assert s["drafter_reconnects"] > reconnects and s["drafter_connected"], s
    after = ray.get(spread.drafter.info.remote(), timeout=30)
    assert after["pid"] != before["pid"] and after["node_id"] == before["node_id"]
    assert after["node_id"] != spread.info()["verifier"]["node_id"]
    rounds = s["ssd_rounds"]
    _complete_exact(spread, link_pki, real_reference)
    assert _stats(spread, link_pki)["ssd_rounds"] > rounds


def test_the_launch_health_check_follows_the_public_tls() -> None:
    """With TLS on the public API, the launcher health-checks it over TLS (plaintext would be refused)."""
    from cluster.launch import link_security, public_tls

    public = {"tls_cert": "/c.pem", "tls_key": "/k.pem"}
    assert public_tls(public) == TLSFiles("/c.pem", "/k.pem") and public_tls({}) is None
    assert public_tls({"tls_cert": "/c.pem"}) is None
    assert link_security("node-ip", public).verifier_tls == TLSFiles("/c.pem", "/k.pem", ca="/c.pem")
