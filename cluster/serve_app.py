"""Ray Serve application: each replica owns one drafter–verifier pair on its own placement-group bundles.

Import path: ``cluster.serve_app:app`` (defaults: the shipped pair), or the builder ``cluster.serve_app:build_app``
with args (see :func:`build_app`). Importing this module has no side effects (no Ray start, no model load).

Per replica, Serve reserves three bundles atomically: the replica itself (bundle 0, light) and one GPU (or CPU
share) each for the drafter (bundle 1) and the verifier (bundle 2). The replica starts the pair with
:func:`cluster.launch.launch` inside that placement group and forwards to the verifier's gRPC server.

Ingress:
  * gRPC through Serve's gRPC proxy: register ``protos.ssd.v1.ssd_pb2_grpc.add_GenerationServicer_to_server``
    (and ``grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server`` for Kubernetes probes) in
    ``grpc_options.grpc_servicer_functions``; methods ``Generate`` (streaming), ``Complete``, ``GetStats``, ``Check``.
  * HTTP (OpenAI-compatible): the handlers of ``ssd serve --http-port``
    (:class:`verifier_service.openai_http.OpenAIHandlers`): ``POST /v1/chat/completions``, ``POST /v1/completions``,
    ``GET /v1/models``, ``/health`` and ``/metrics`` (this replica's verifier).

``max_ongoing_requests`` is the engine's admission queue (64), not Serve's default 5, and ``check_health`` asks
the verifier's gRPC health service.
"""



import logging
import urllib.request
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from ray import serve
from starlette.exceptions import HTTPException

from verifier_service.openai_front_door import DEFAULT_MAX_BODY_BYTES, FrontDoor, http_error, internal_error

logger = logging.getLogger(__name__)



class ReplicaFrontDoor(FrontDoor):
    """``ssd serve --http-port``'s front door with this replica's bearer token and body limit, which the replica
    sets as it starts, before it serves (one replica per process)."""

    token: str | None = None
    limit: int = DEFAULT_MAX_BODY_BYTES

    def __init__(self, app) -> None:
        super().__init__(app, None, DEFAULT_MAX_BODY_BYTES)

    async def __call__(self, scope, receive, send) -> None:
        self._expected = f"Bearer {self.token}".encode() if self.token else None
        self.max_body_bytes = self.limit
        await super().__call__(scope, receive, send)


api = FastAPI(title="ssd-serve", description="OpenAI-compatible API over speculative speculative decoding")
# the token, then the body limit before a byte past it is read; every refusal (an unknown path or method, a
# crash) in OpenAI's error shape
api.add_exception_handler(HTTPException, http_error)
api.add_exception_handler(Exception, internal_error)
api.add_middleware(ReplicaFrontDoor)

#: Requests one replica takes at once: its engine's admission queue, far above Serve's default of 5.
MAX_ONGOING_REQUESTS = 64


# Serve's ingress copies the class as it is decorated: the module names it uses must exist before it.
def ray_group():
    import ray

    return ray.util.get_current_placement_group()


def replica_config(args: dict):
    """A replica's pair: the one config's keys as given, with the public ports any free one unless given (Serve's
    proxy is the ingress) and a metrics endpoint always (the replica's ``/metrics`` reads it)."""
    from spec_core.settings import ServiceConfig

    keys = {k: v for k, v in args.items() if k in ServiceConfig.model_fields}
    for key in ("port", "metrics_port"):
        if keys.get(key) is None:
            keys[key] = 0
    return ServiceConfig.load(None, keys)


def _forwarded(grpc_context) -> tuple:
    """The caller's ``authorization`` metadata, for the verifier's own check."""
    if grpc_context is None:
        return ()
    return tuple((k, v) for k, v in grpc_context.invocation_metadata() if k == "authorization")


def _pass_on(exc: grpc.aio.AioRpcError, grpc_context) -> None:
    """The verifier's status and message, for Serve's proxy to answer with (re-raised outside a gRPC call)."""
    if grpc_context is None:
        raise exc
    grpc_context.set_code(exc.code())
    grpc_context.set_details(exc.details() or "")


async def _unary(method, request, timeout_s: float, grpc_context, empty):
    """``method(request)`` on the verifier with the caller's token; a refusal passed on (:func:`_pass_on`), with an
    ``empty()`` message for Serve's proxy to send beside it."""
    try:
        return await method(request, timeout=timeout_s, metadata=_forwarded(grpc_context))
    except grpc.aio.AioRpcError as exc:
        _pass_on(exc, grpc_context)
        return empty()


def _scrape(address: str) -> bytes:
    """This replica's verifier metrics (its own Prometheus endpoint, on the replica's node)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read()


@serve.deployment(name="SSDServer", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                  health_check_period_s=10, health_check_timeout_s=30)
@serve.ingress(api)
class SSDServer:
    def __init__(self, config: dict) -> None:
        """``config``: the keys of :class:`spec_core.settings.ServiceConfig` given to :func:`build_app`."""
        from grpc import aio

        from cluster.launch import LaunchOptions, launch, public_tls
        from protos.security import read_secret
        from protos.serving import channel_options, retry_service_config
        from protos.ssd.v1 import ssd_pb2_grpc
        from spec_core.model_paths import model_name as name_of
        from verifier_service.openai_http import OpenAIHandlers

        cfg = replica_config(config)
        self.drain_grace = cfg.drain_grace
        ReplicaFrontDoor.token = read_secret(cfg.auth_token_file, cfg.auth_token_env)
        ReplicaFrontDoor.limit = cfg.max_body_bytes
        self.deployment = launch(cfg, placement_group=ray_group(), options=LaunchOptions(pin_cores=True))
        self.model_name = cfg.served_model_name or name_of(cfg.model_paths()[0])
        # gRPC's own retry policy rides out a restarting verifier actor (before a stream's first message only)
        options = channel_options(retry_service_config(5, 0.25, 4.0), max_reconnect_backoff_s=4.0)
        tls = public_tls(cfg.public_security())
        # with TLS, the replica trusts the public certificate itself, as the launcher's health check does
        self.channel = (aio.secure_channel(self.deployment.address, grpc.ssl_channel_credentials(
            Path(tls.cert).read_bytes()), options=options) if tls
            else aio.insecure_channel(self.deployment.address, options=options))
        self.stub = ssd_pb2_grpc.GenerationStub(self.channel)
        metrics_at = self.deployment.info()["verifier"]["metrics_address"]
        self.handlers = OpenAIHandlers(lambda: self.stub, [self.model_name], self._health_stub,
                                       lambda: _scrape(metrics_at), max_body_bytes=cfg.max_body_bytes)
        logger.info("replica ready: verifier %s, model %s", self.deployment.address, self.model_name)

    def _health_stub(self):
        from grpc_health.v1 import health_pb2_grpc

        return health_pb2_grpc.HealthStub(self.channel)

    async def check_health(self) -> None:
        """Serve's replica health check: the verifier must answer SERVING (else Serve replaces the replica)."""
        from grpc_health.v1 import health_pb2

        resp = await self._health_stub().Check(health_pb2.HealthCheckRequest(service="ssd.v1.Generation"),
                                               timeout=20)
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"verifier at {self.deployment.address} is not SERVING")

    # ---- gRPC methods (called by Serve's gRPC proxy with the request message) ---------------------------------
    # The caller's bearer token travels on to the verifier, which checks it (``auth-token-file``); the verifier's
    # refusals reach the caller with their own status (Serve's proxy would answer INTERNAL for an exception).
    async def Generate(self, request, grpc_context=None):  # noqa: N802 - gRPC method name
        try:
            async for resp in self.stub.Generate(request, timeout=3600, metadata=_forwarded(grpc_context)):
                yield resp
        except grpc.aio.AioRpcError as exc:
            _pass_on(exc, grpc_context)

    async def Complete(self, request, grpc_context=None):  # noqa: N802
        from protos.ssd.v1 import ssd_pb2 as pb

        return await _unary(self.stub.Complete, request, 3600, grpc_context, pb.GenerateResult)

    async def GetStats(self, request, grpc_context=None):  # noqa: N802
        from protos.ssd.v1 import ssd_pb2 as pb

        return await _unary(self.stub.GetStats, request, 30, grpc_context, pb.StatsResponse)

    async def Check(self, request):  # noqa: N802 - grpc.health.v1.Health/Check for Kubernetes probes
        from grpc_health.v1 import health_pb2

        resp = await self._health_stub().Check(health_pb2.HealthCheckRequest(service="ssd.v1.Generation"),
                                               timeout=10)
        return health_pb2.HealthCheckResponse(status=resp.status)

    # ---- OpenAI-compatible HTTP: the same handlers as ``ssd serve --http-port`` ----------------------------------
    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.handlers.chat_completions(request)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.handlers.completions(request)

    @api.get("/v1/models")
    async def models(self, request: Request):
        return await self.handlers.models(request)

    @api.get("/health")
    async def health(self, request: Request):
        return await self.handlers.health(request)

    @api.get("/metrics")
    async def metrics(self, request: Request):
        return await self.handlers.metrics(request)

    def info(self) -> dict:
        return self.deployment.info()

    def __del__(self) -> None:
        dep = getattr(self, "deployment", None)
        if dep is not None:
            dep.shutdown(grace_s=self.drain_grace, remove_group=False)


def pair_bundles(use_gpu: bool, pair_cpus: float, replica_cpus: float,
                 gpu_fraction: float = 1.0) -> list[dict[str, float]]:
    """Bundle 0: the replica; bundles 1 and 2: drafter and verifier (``gpu_fraction`` of a GPU each)."""
    device = {"GPU": gpu_fraction, "CPU": pair_cpus} if use_gpu else {"CPU": pair_cpus}
    return [{"CPU": replica_cpus}, dict(device), dict(device)]


def _warn_if_unschedulable(replicas: int, bundles: list[dict[str, float]]) -> None:
    """One clear line when the cluster (as it is now) cannot hold every replica, instead of Serve's repeated
    "taken more than 30s to be scheduled" (an autoscaling cluster may still add the nodes)."""
    import ray

    if not ray.is_initialized():
        return
    have = ray.cluster_resources()
    for res in ("CPU", "GPU"):
        need = replicas * sum(b.get(res, 0.0) for b in bundles)
        if need > have.get(res, 0.0) + 1e-9:
            logger.warning("%d replica(s) need %.1f %s in all (%s per replica); this cluster has %.1f: lower "
                           "num-replicas, pair-cpus or gpu-fraction, or add nodes", replicas, need, res,
                           bundles, have.get(res, 0.0))


#: Keys that have no effect inside a Serve application (it runs in its cluster; Serve's proxy is the ingress).
NOT_IN_A_REPLICA = ("address", "num_cpus")


def build_app(args: dict):
    """Application builder: ``serve run cluster.serve_app:build_app gpu=no num-replicas=2``.

    Args: every key of the one configuration model (:class:`spec_core.settings.ServeAppConfig`; dashes or
    underscores; ``docs/configuration.md``), validated here: an unknown key or a bad value raises ValueError naming
    it. ``gpu`` defaults to ``yes`` (a GPU each for drafter and verifier)."""
    from spec_core.settings import ServeAppConfig, ServiceConfig

    args = {str(k).replace("-", "_"): v for k, v in args.items()}
    args.setdefault("gpu", "yes")
    cfg = ServeAppConfig.load(None, args)
    for key in NOT_IN_A_REPLICA:
        if key in cfg.model_fields_set:
            logger.warning("%s has no effect in a Serve application", key)
    use_gpu = cfg.gpu != "no"
    bundles = pair_bundles(use_gpu, cfg.pair_cpus, cfg.replica_cpus, cfg.gpu_fraction)
    ongoing = max(cfg.max_ongoing_requests or cfg.max_queue, cfg.max_num_seqs)
    _warn_if_unschedulable(cfg.num_replicas, bundles)
    pair = cfg.model_dump(include=set(cfg.model_fields_set) & set(ServiceConfig.model_fields) - set(NOT_IN_A_REPLICA))
    pair.update(gpu="yes" if use_gpu else "no", max_queue=ongoing)
    return SSDServer.options(
        num_replicas=cfg.num_replicas, max_ongoing_requests=ongoing,
        ray_actor_options={"num_cpus": bundles[0]["CPU"]}, placement_group_bundles=bundles,
        placement_group_strategy=cfg.strategy,
    ).bind(pair)



#: The default application: one replica, a GPU each for drafter and verifier (override with ``build_app``).
app = build_app({})
