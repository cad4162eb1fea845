"""Place a drafter–verifier pair with Ray and start their gRPC servers (what ``ssd serve`` and the Serve app use).

The drafter's bind host and the link's credentials are decided in one place (:func:`drafter_bind_host`,
:func:`link_security`): loopback when drafter and verifier share a node; beyond loopback, the link takes the public
API's TLS certificate and bearer token.

Order: create one placement group with one bundle per actor ({"GPU": f, "CPU": 1} each when the cluster has the
GPUs, with f = ``gpu_fraction``: 1 for a GPU each, 0.5 for both on one GPU; else {"CPU": 1} each) and wait for it with a timeout (an infeasible group, e.g. STRICT_SPREAD on
one node, stays PENDING forever); start the drafter (a named actor) and the verifier, which looks the drafter up
by name, connects and handshakes; health-check both servers; only then report the public address.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.actors import DrafterActor, VerifierActor
from drafter_service.server import DrafterServerConfig
from protos.security import TLSFiles, is_loopback
from spec_core.config import (
    CacheConfig,
    ModelConfig,
    draft_dtype,
    resolve_dtype,
)
from spec_core.settings import ServiceConfig
from verifier_service.scheduler import SchedulerConfig
from verifier_service.server import VerifierServerConfig

logger = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class LinkSecurity:
    """The drafter link's credentials: the drafter's server TLS and token, and the verifier's client TLS."""

    drafter_tls: TLSFiles | None = None
    verifier_tls: TLSFiles | None = None
    auth_token_file: str | None = None
    auth_token_env: str | None = None


def link_security(host: str, public: dict) -> LinkSecurity:
    """None on loopback; beyond it, the public API's settings (``public``: the verifier's ``tls_cert``,
    ``tls_key``, ``auth_token_file``, ``auth_token_env``). The verifier trusts the public certificate itself, so
    it must name the drafter's address (self-signed, or with the node IPs among its subject names)."""
    if is_loopback(host):
        return LinkSecurity()
    server = public_tls(public)
    client = TLSFiles(server.cert, server.key, ca=server.cert) if server else None
    return LinkSecurity(server, client, public.get("auth_token_file"), public.get("auth_token_env"))


def public_tls(public: dict) -> TLSFiles | None:
    """The public API's certificate and key (None: plaintext). The launcher's health check trusts the certificate
    itself, as the link does, so it must name the address the verifier reports."""
    cert, key = public.get("tls_cert"), public.get("tls_key")
    return TLSFiles(cert, key) if cert and key else None


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """How the launcher runs the pair (not part of the deployment's configuration)."""

    #: The actors' log level (the driver's: ``ssd -v serve`` logs INFO in them too).
    log_level: int = logging.WARNING
    pin_cores: bool = True  # CPU only: pin verifier to core 0, drafter to core 1 (of each actor's node)
    placement_timeout_s: float = 60.0
    start_timeout_s: float = 300.0


def verifier_config(cfg: ServiceConfig, target: str, drafter_host: str = "127.0.0.1") -> VerifierServerConfig:
    """The verifier's settings; ``drafter_host``: where the drafter listens (its link's credentials follow)."""
    public = cfg.public_security()
    target_model = ModelConfig(target, cfg.dtype, cfg.device, cuda_graphs=not cfg.enforce_eager)
    return VerifierServerConfig(target_model, spec=cfg.speculation(),
                                cache=CacheConfig(kv_memory_fraction=cfg.kv_memory_fraction),
                                scheduler=SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                                                          max_num_batched_tokens=cfg.max_num_batched_tokens),
                                host=cfg.host, port=cfg.port, max_queue=cfg.max_queue,
                                metrics_port=cfg.metrics_port, http_port=cfg.http_port,
                                served_model_name=cfg.served_model_name, max_model_len=cfg.max_model_len,
                                stats_log_interval_s=cfg.stats_log_interval, max_body_bytes=cfg.max_body_bytes,
                                internal_tls=link_security(drafter_host, public).verifier_tls, **public)


def drafter_config(cfg: ServiceConfig, target: str, draft: str, host: str = "127.0.0.1",
                   on_gpu: bool = False) -> DrafterServerConfig:
    """The drafter's settings, bound to ``host`` ("node-ip": the node's IP) with the link's credentials. On CPUs
    the draft's dtype (unless ``draft_dtype`` is given) follows the target's as it resolves there (an int4 target:
    an int4 draft), as locally."""
    target_dtype = cfg.dtype if on_gpu or cfg.device not in ("auto", "cpu") else resolve_dtype(cfg.dtype, "cpu",
                                                                                                target)
    model = ModelConfig(draft, cfg.draft_dtype or draft_dtype(target_dtype, path=draft), cfg.device,
                        cuda_graphs=not cfg.enforce_eager)
    sec = link_security(host, cfg.public_security())
    return DrafterServerConfig(model, cfg.ssd_config(), host=host, kv_memory_fraction=cfg.kv_memory_fraction,
                               tls=sec.drafter_tls, auth_token_file=sec.auth_token_file,
                               auth_token_env=sec.auth_token_env)


@dataclass(slots=True)
class Deployment:
    pg: object
    drafter: object
    verifier: object
    drafter_address: str
    address: str
    use_gpu: bool

    def info(self, timeout_s: float = 30.0) -> dict:
        d, v = ray.get([self.drafter.info.remote(), self.verifier.info.remote()], timeout=timeout_s)
        return {"address": self.address, "drafter": d, "verifier": v, "use_gpu": self.use_gpu}

    def shutdown(self, grace_s: float = 30.0, remove_group: bool = True) -> None:
        """Drain the verifier (in-flight streams finish), then stop both actors and free the placement group
        (unless it belongs to someone else, e.g. a Serve replica)."""
        try:
            ray.get(self.verifier.drain.remote(grace_s), timeout=grace_s + 30)
        except Exception:  # noqa: BLE001 - best effort; the actors are killed next
            logger.exception("drain failed")
        release(self.pg if remove_group else None, (self.verifier, self.drafter))


def release(pg, actors, timeout_s: float = 15.0) -> None:
    """Kill the actors and remove their placement group, never blocking shutdown for more than ``timeout_s``
    (removal blocks when the local raylet is already gone, e.g. after a terminal's Ctrl-C reached it)."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
    if pg is None:
        return
    t = threading.Thread(target=remove_placement_group, args=(pg,), daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        logger.warning("placement group removal did not finish within %.0f s", timeout_s)


def bundles_for(use_gpu: bool, gpu_fraction: float = 1.0) -> list[dict[str, float]]:
    """One bundle per actor: a CPU each, and ``gpu_fraction`` of a GPU each when ``use_gpu``."""
    if not 0 < gpu_fraction <= 1:
        raise ValueError(f"gpu_fraction must be in (0, 1], got {gpu_fraction}")
    one = {"GPU": gpu_fraction, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
    return [dict(one), dict(one)]


def drafter_bind_host(setting: str, pg, first: int) -> str:
    """Where the drafter listens. "auto": loopback when its bundle (``first``) and the verifier's (``first + 1``)
    are on one node, so nothing off the node reaches it; else the node's IP ("node-ip")."""
    if setting != "auto":
        return setting
    nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    return "127.0.0.1" if nodes[first] == nodes[first + 1] else "node-ip"


def check_health(address: str, service: str, timeout_s: float = 10.0, tls: TLSFiles | None = None) -> None:
    """``tls``: the server's own certificate, trusted as the root (the drafter's link credentials)."""
    creds = grpc.ssl_channel_credentials(root_certificates=open(tls.cert, "rb").read()) if tls else None
    with (grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=timeout_s)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        raise RuntimeError(f"{service} at {address} is not SERVING")


def launch(cfg: ServiceConfig, placement_group=None, options: LaunchOptions = LaunchOptions()) -> Deployment:
    """Start the pair. With ``placement_group`` (a Serve replica's own group: bundle 0 is the replica), the
    drafter and verifier take bundles 1 and 2 of it; otherwise a new two-bundle group is created and awaited."""
    target, draft = cfg.model_paths()
    own = placement_group is None
    if own:
        enough = ray.cluster_resources().get("GPU", 0) >= 2 * cfg.gpu_fraction
        use_gpu = cfg.use_gpu if cfg.use_gpu is not None else enough
        bundles = bundles_for(use_gpu, cfg.gpu_fraction)
        pg = _new_group(bundles, cfg.strategy, options.placement_timeout_s)
        first = 0
    else:
        pg, first = placement_group, 1
        bundles = pg.bundle_specs[1:3]
        use_gpu = bundles[0].get("GPU", 0) > 0
    cpus = [b.get("CPU", 0.0) for b in bundles]
    gpus = [b.get("GPU", 0.0) for b in bundles]
    pin = options.pin_cores and not use_gpu
    # The drafter is restarted by Ray if it dies (the verifier serves from its backup meanwhile, then reconnects).
    name, namespace = f"ssd-drafter-{uuid.uuid4().hex[:12]}", ray.get_runtime_context().namespace
    host = drafter_bind_host(cfg.drafter_host, pg, first)
    drafter = DrafterActor.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first),
        num_cpus=cpus[0], num_gpus=gpus[0], max_restarts=-1, name=name, namespace=namespace,
    ).remote(drafter_config(cfg, target, draft, host, on_gpu=use_gpu), 1 if pin else None,
              log_level=options.log_level)
    # The verifier too: it comes back on the same public port (clients see UNAVAILABLE meanwhile and retry).
    verifier = VerifierActor.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first + 1),
        num_cpus=cpus[1], num_gpus=gpus[1], max_restarts=-1,
    ).remote(verifier_config(cfg, target, host), 0 if pin else None, name,
              connect_timeout_s=options.start_timeout_s, namespace=namespace, log_level=options.log_level,
              lend=cfg.lend_cores and pin)
    if not own:
        pg = None  # not ours to remove
    try:
        d_addr = ray.get(drafter.address.remote(), timeout=options.start_timeout_s)
        ray.get(drafter.check_health.remote(), timeout=30)
        address = ray.get(verifier.address.remote(), timeout=options.start_timeout_s)
        check_health(address, "ssd.v1.Generation", tls=public_tls(cfg.public_security()))
    except BaseException:
        release(pg, (verifier, drafter))
        raise
    logger.info("drafter %s, verifier %s", d_addr, address)
    return Deployment(pg, drafter, verifier, d_addr, address, use_gpu)


def _new_group(bundles: list[dict[str, float]], strategy: str, timeout_s: float):
    pg = placement_group(bundles, strategy=strategy)
    t0 = time.monotonic()
    if not pg.wait(timeout_seconds=timeout_s):
        remove_placement_group(pg)
        raise PlacementError(f"placement group {bundles} ({strategy}) not ready after "
                             f"{timeout_s:.0f} s; free resources: {ray.available_resources()}")
    logger.info("placement group ready in %.2f s: %s", time.monotonic() - t0, bundles)
    return pg
