"""Ray actors hosting the drafter and verifier gRPC servers.

Each actor runs in its own worker process on its own bundle of a placement group: one GPU each when GPUs exist
(Ray sets ``CUDA_VISIBLE_DEVICES``, so the model goes to ``cuda:0`` of that process), otherwise one CPU each,
pinned to its own core when ``core`` is given. Torch threads follow the actor's CPU share. The drafter binds the
host :func:`cluster.launch.drafter_bind_host` chose (``node-ip``: the node IP Ray reports); the verifier's public
server binds the configured host. Each actor logs at the driver's level (Ray's workers otherwise drop INFO), and the
verifier's periodic stats line always shows when it is on.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace

import ray
import torch

from drafter_service.server import DrafterServer, DrafterServerConfig
from verifier_service.server import VerifierServer, VerifierServerConfig

logger = logging.getLogger(__name__)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int) -> None:
    """Log at ``level`` to stderr (Ray forwards it to the driver); Ray's workers start with no handler at WARNING.
    The stats log line is INFO and asked for by its interval setting, so it shows at any level."""
    root = logging.getLogger()
    root.setLevel(level)
    if not any(getattr(h, "_ssd", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler._ssd = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    logging.getLogger("verifier_service.stats_log").setLevel(logging.INFO)


def _setup_process(core: int | None) -> str:
    """Pin (CPU only), set torch threads to this actor's CPU share, and pick the device."""
    resources = ray.get_runtime_context().get_assigned_resources()
    gpus = ray.get_gpu_ids()
    if core is not None and not gpus and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[core % len(cores)]})
    torch.set_num_threads(max(1, int(round(resources.get("CPU", 1.0)))))
    return "cuda" if gpus and torch.cuda.is_available() else "cpu"


def _info() -> dict:
    ctx = ray.get_runtime_context()
    pg = ctx.get_placement_group_id()
    return {
        "pid": os.getpid(),
        "node_id": ctx.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "placement_group_id": pg,
        "assigned_resources": ctx.get_assigned_resources(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
    }


def _lend_core(drafter) -> int | None:
    """The drafter's core, where it runs pinned to one core of this node other than this process's own."""
    info = ray.get(drafter.info.remote(), timeout=30)
    own = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    theirs = info.get("affinity") or []
    same_node = info.get("node_id") == ray.get_runtime_context().get_node_id()
    return theirs[0] if same_node and len(own) == 1 and len(theirs) == 1 and theirs != own else None


@ray.remote
class DrafterActor:
    """Serves as soon as it is constructed, so a Ray restart (``max_restarts``) brings the server back by itself;
    the verifier then asks for the new address and reconnects."""

    def __init__(self, config: DrafterServerConfig, core: int | None = None, log_level: int = logging.WARNING) -> None:
        setup_logging(log_level)
        device = _setup_process(core)
        host = ray.util.get_node_ip_address() if config.host == "node-ip" else config.host
        draft = config.draft if config.draft.device != "auto" else replace(config.draft, device=device)
        self.server = DrafterServer(replace(config, host=host, draft=draft))
        self.server.start()

    def address(self) -> str:
        """The drafter's gRPC address (the server already runs; awaiting this awaits readiness)."""
        return self.server.address

    def check_health(self) -> None:
        """Health-checked from its own node: a loopback-bound drafter is reachable from nowhere else."""
        from cluster.launch import check_health

        check_health(self.server.address, "ssd.v1.Drafter", tls=self.server.config.tls)

    def pid(self) -> int:
        return os.getpid()

    def info(self) -> dict:
        return {**_info(), "address": self.server.address, "device": str(self.server.runner.device),
                "sessions": self.server.servicer.sessions_started}

    def stop(self) -> None:
        self.server.stop()


@ray.remote
class VerifierActor:
    """Serves as soon as it is constructed, like the drafter: when Ray restarts it (``max_restarts``) it binds the
    same public port again (a fixed port; port 0 would pick a new one), asks the drafter actor for its current
    address, and serves. Streams in flight when it died end with UNAVAILABLE at the client."""

    def __init__(self, config: VerifierServerConfig, core: int | None = None, drafter: str | None = None,
                 connect_timeout_s: float = 300.0, namespace: str | None = None,
                 log_level: int = logging.WARNING, lend: bool = False) -> None:
        """``drafter``: the drafter actor's name (in ``namespace``), asked for its current address now and whenever
        the link must be re-established (after a drafter restart). A name, not a handle: a restartable actor's
        constructor arguments must stay valid for its whole life. ``lend``: borrow the drafter's core for plain
        steps where it is pinned on this node (:func:`_lend_core`)."""
        setup_logging(log_level)
        device = _setup_process(core)
        host = ray.util.get_node_ip_address() if config.host == "node-ip" else config.host
        target = config.target if config.target.device != "auto" else replace(config.target, device=device)
        resolver, drafter_address, lend_core = None, None, None
        if drafter is not None and config.spec.mode == "ssd":
            handle = ray.get_actor(drafter, namespace=namespace)
            resolver = lambda: ray.get(handle.address.remote(), timeout=10)  # noqa: E731
            drafter_address = ray.get(handle.address.remote(), timeout=connect_timeout_s)
            lend_core = _lend_core(handle) if lend and device == "cpu" else None
        self.server = VerifierServer(replace(config, host=host, target=target, lend_core=lend_core))
        self.server.start(drafter_address, resolver)

    def address(self) -> str:
        """The public address (the server already runs; awaiting this awaits readiness)."""
        return self.server.address

    def pid(self) -> int:
        return os.getpid()

    def info(self) -> dict:
        engine = self.server.engine_loop.engine if self.server.engine_loop is not None else None
        return {**_info(), "address": self.server.address, "device": str(self.server.pair.target.device),
                "lending": engine is not None and engine.lending is not None,
                "metrics_address": self.server.metrics_address, "http_address": self.server.http_address,
                "model_name": self.server.model_name}

    def stats(self) -> dict:
        return self.server.stats()

    def drain(self, grace_s: float | None = None) -> bool:
        return self.server.drain(grace_s)

    def stop(self) -> None:
        self.server.stop()
