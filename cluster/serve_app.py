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

from fastapi import FastAPI, Request
from ray import serve
from starlette.exceptions import HTTPException

from verifier_service.openai_front_door import DEFAULT_MAX_BODY_BYTES, FrontDoor, http_error, internal_error

logger = logging.getLogger(__name__)

api = FastAPI(title="ssd-serve", description="OpenAI-compatible API over speculative speculative decoding")
# the front door of ``ssd serve --http-port``: the body limit before a byte past it is read, every refusal (an
# unknown path or method, a crash) in OpenAI's error shape; authentication stays the verifier's gRPC own here
api.add_exception_handler(HTTPException, http_error)
api.add_exception_handler(Exception, internal_error)
api.add_middleware(FrontDoor, token=None, max_body_bytes=DEFAULT_MAX_BODY_BYTES)

#: Requests one replica takes at once: its engine's admission queue, far above Serve's default of 5.
MAX_ONGOING_REQUESTS = 64


@serve.deployment(name="SSDServer", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                  health_check_period_s=10, health_check_timeout_s=30)
@serve.ingress(api)
class SSDServer:
    def __init__(self, target: str | None = None, draft: str | None = None, k: int = 2,
                 use_gpu: bool | None = None, model_name: str | None = None, dtype: str = "auto",
                 device: str = "auto", max_num_seqs: int = 16, max_queue: int = MAX_ONGOING_REQUESTS) -> None:
        import ray
        from grpc import aio

        from cluster.launch import PairConfig, launch
        from protos.serving import channel_options, retry_service_config
        from protos.ssd.v1 import ssd_pb2_grpc
        from spec_core.model_paths import default_pair
        from spec_core.model_paths import model_name as name_of
        from verifier_service.openai_http import OpenAIHandlers

        pair = default_pair() if not (target and draft) else {}
        target, draft = target or pair["target"], draft or pair["draft"]
        pg = ray.util.get_current_placement_group()
        cfg = PairConfig(target, draft, k=k, port=0, use_gpu=use_gpu, dtype=dtype, device=device,
                         max_num_seqs=max_num_seqs, max_queue=max_queue, metrics_port=0)
        self.deployment = launch(cfg, placement_group=pg)
        self.model_name = model_name or name_of(target)
        # gRPC's own retry policy rides out a restarting verifier actor (before a stream's first message only)
        self.channel = aio.insecure_channel(self.deployment.address, options=channel_options(
            retry_service_config(5, 0.25, 4.0), max_reconnect_backoff_s=4.0))
        self.stub = ssd_pb2_grpc.GenerationStub(self.channel)
        metrics_at = self.deployment.info()["verifier"]["metrics_address"]
        self.handlers = OpenAIHandlers(lambda: self.stub, [self.model_name], self._health_stub,
                                       lambda: _scrape(metrics_at))
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
    async def Generate(self, request):  # noqa: N802 - gRPC method name
        async for resp in self.stub.Generate(request, timeout=3600):
            yield resp

    async def Complete(self, request):  # noqa: N802
        return await self.stub.Complete(request, timeout=3600)

    async def GetStats(self, request):  # noqa: N802
        return await self.stub.GetStats(request, timeout=30)

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
            dep.shutdown(grace_s=10.0, remove_group=False)


def _scrape(address: str) -> bytes:
    """This replica's verifier metrics (its own Prometheus endpoint, on the replica's node)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read()


#: Defaults that fit the embedded default (2 CPUs) with 2 replicas: 2 x (0.1 + 0.4 + 0.4) = 1.8 CPUs.
PAIR_CPUS, REPLICA_CPUS = 0.4, 0.1


def pair_bundles(use_gpu: bool, pair_cpus: float = PAIR_CPUS, replica_cpus: float = REPLICA_CPUS,
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
                           "num_replicas, pair_cpus or gpu_fraction, or add nodes", replicas, need, res,
                           bundles, have.get(res, 0.0))


def build_app(args: dict):
    """Application builder: ``serve run cluster.serve_app:build_app use_gpu=false num_replicas=2``.

    Args (all optional): ``target``, ``draft`` (folders or .gguf; default ``ssd models``), ``model_name``,
    ``dtype``, ``device``, ``k``, ``use_gpu``, ``gpu_fraction``, ``num_replicas``, ``pair_cpus``,
    ``replica_cpus``, ``max_num_seqs``, ``max_ongoing_requests``, ``strategy``."""
    def flag(v):
        return v if isinstance(v, bool) or v is None else str(v).lower() in ("1", "true", "yes")

    use_gpu = flag(args.get("use_gpu", True))
    bundles = pair_bundles(use_gpu, float(args.get("pair_cpus", PAIR_CPUS)),
                           float(args.get("replica_cpus", REPLICA_CPUS)),
                           float(args.get("gpu_fraction", 1.0)))  # 0.5: both actors of a replica share one GPU
    replicas = int(args.get("num_replicas", 1))
    max_seqs = int(args.get("max_num_seqs", 16))
    ongoing = max(int(args.get("max_ongoing_requests", MAX_ONGOING_REQUESTS)), max_seqs)
    _warn_if_unschedulable(replicas, bundles)
    return SSDServer.options(
        num_replicas=replicas, max_ongoing_requests=ongoing, ray_actor_options={"num_cpus": bundles[0]["CPU"]},
        placement_group_bundles=bundles, placement_group_strategy=args.get("strategy", "PACK"),
    ).bind(target=args.get("target"), draft=args.get("draft"), k=int(args.get("k", 2)), use_gpu=use_gpu,
           model_name=args.get("model_name"), dtype=str(args.get("dtype", "auto")),
           device=str(args.get("device", "auto")), max_num_seqs=max_seqs, max_queue=ongoing)


#: The default application: one replica, a GPU each for drafter and verifier (override with ``build_app``).
app = build_app({})
