"""Ray Serve application: each replica owns one drafter–verifier pair on its own placement-group bundles.

Import path: ``cluster.serve_app:app`` (defaults: the shipped pair), or the builder ``cluster.serve_app:build_app``
with args (``target``, ``draft``, ``k``, ``use_gpu``, ``gpu_fraction``, ``num_replicas``, ``pair_cpus``,
``replica_cpus``). Importing this module has no side effects (no Ray start, no model load).

Per replica, Serve reserves three bundles atomically: the replica itself (bundle 0, light) and one GPU (or CPU
share) each for the drafter (bundle 1) and the verifier (bundle 2). The replica starts the pair with
:func:`cluster.launch.launch` inside that placement group and forwards to the verifier's gRPC server.

Ingress:
  * gRPC through Serve's gRPC proxy: register ``protos.ssd.v1.ssd_pb2_grpc.add_GenerationServicer_to_server``
    (and ``grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server`` for Kubernetes probes) in
    ``grpc_options.grpc_servicer_functions``; methods ``Generate`` (streaming), ``Complete``, ``GetStats``, ``Check``.
  * HTTP (OpenAI-compatible): ``POST /v1/completions`` (``"stream": true`` gives server-sent events) and
    ``GET /v1/models``.
"""



import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from cluster import openai_api

logger = logging.getLogger(__name__)

api = FastAPI(title="ssd-serve", description="OpenAI-compatible completions over speculative speculative decoding")


@serve.deployment(name="SSDServer", ray_actor_options={"num_cpus": 0.5})
@serve.ingress(api)
class SSDServer:
    def __init__(self, target: str | None = None, draft: str | None = None, k: int = 2,
                 use_gpu: bool | None = None, model_name: str = "ssd-default", dtype: str = "auto") -> None:
        import ray
        from grpc import aio

        from cluster.launch import PairConfig, launch
        from protos.serving import channel_options
        from protos.ssd.v1 import ssd_pb2_grpc
        from spec_core.model_paths import default_pair

        pair = default_pair()
        pg = ray.util.get_current_placement_group()
        cfg = PairConfig(target or pair["target"], draft or pair["draft"], k=k, port=0, use_gpu=use_gpu, dtype=dtype)
        self.deployment = launch(cfg, placement_group=pg)
        self.model_name = model_name
        self.channel = aio.insecure_channel(self.deployment.address, options=channel_options())
        self.stub = ssd_pb2_grpc.GenerationStub(self.channel)
        logger.info("replica ready: verifier %s", self.deployment.address)

    # ---- gRPC methods (called by Serve's gRPC proxy with the request message) ---------------------------------
    async def Generate(self, request):  # noqa: N802 - gRPC method name
        async for resp in self.stub.Generate(request, timeout=3600):
            yield resp

    async def Complete(self, request):  # noqa: N802
        return await self.stub.Complete(request, timeout=3600)

    async def GetStats(self, request):  # noqa: N802
        return await self.stub.GetStats(request, timeout=30)

    async def Check(self, request):  # noqa: N802 - grpc.health.v1.Health/Check for Kubernetes probes
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        resp = await health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service="ssd.v1.Generation"), timeout=10)
        return health_pb2.HealthCheckResponse(status=resp.status)

    # ---- OpenAI-compatible HTTP -------------------------------------------------------------------------------
    @api.get("/v1/models")
    async def list_models(self) -> dict:
        return openai_api.models(self.model_name)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        import grpc

        try:
            req, stream = openai_api.parse_completion(await request.json())
        except ValueError as exc:
            return JSONResponse(openai_api.error_body(str(exc)), status_code=400)
        if stream:
            return StreamingResponse(self._sse(req), media_type="text/event-stream")
        try:
            result = await self.stub.Complete(req, timeout=3600)
        except grpc.aio.AioRpcError as exc:
            return JSONResponse(openai_api.error_body(exc.details() or exc.code().name),
                                status_code=openai_api.HTTP_STATUS.get(exc.code(), 500))
        return openai_api.completion(result, self.model_name)

    async def _sse(self, req):
        import uuid

        import grpc

        cid = f"cmpl-{uuid.uuid4().hex}"
        try:
            async for resp in self.stub.Generate(req, timeout=3600):
                if resp.WhichOneof("kind") == "delta":
                    d = resp.delta
                    yield openai_api.chunk(cid, self.model_name, d.text, None, list(d.logprobs) or None)
                else:
                    yield openai_api.chunk(cid, self.model_name, "", resp.final.finish_reason or None)
        except grpc.aio.AioRpcError as exc:
            yield f"data: {openai_api.json.dumps(openai_api.error_body(exc.details() or exc.code().name))}\n\n"
        yield openai_api.DONE

    def info(self) -> dict:
        return self.deployment.info()

    def __del__(self) -> None:
        dep = getattr(self, "deployment", None)
        if dep is not None:
            dep.shutdown(grace_s=10.0, remove_group=False)


def pair_bundles(use_gpu: bool, pair_cpus: float = 1.0, replica_cpus: float = 0.5,
                 gpu_fraction: float = 1.0) -> list[dict[str, float]]:
    """Bundle 0: the replica; bundles 1 and 2: drafter and verifier (``gpu_fraction`` of a GPU each)."""
    device = {"GPU": gpu_fraction, "CPU": pair_cpus} if use_gpu else {"CPU": pair_cpus}
    return [{"CPU": replica_cpus}, dict(device), dict(device)]


def build_app(args: dict):
    """Application builder: ``serve run cluster.serve_app:build_app use_gpu=false num_replicas=2``."""
    def flag(v):
        return v if isinstance(v, bool) or v is None else str(v).lower() in ("1", "true", "yes")

    use_gpu = flag(args.get("use_gpu", True))
    cpus = float(args.get("pair_cpus", 1.0))
    replica_cpus = float(args.get("replica_cpus", 0.5))
    gpu_fraction = float(args.get("gpu_fraction", 1.0))  # 0.5: both actors of a replica share one GPU
    return SSDServer.options(
        num_replicas=int(args.get("num_replicas", 1)),
        ray_actor_options={"num_cpus": replica_cpus},
        placement_group_bundles=pair_bundles(use_gpu, cpus, replica_cpus, gpu_fraction),
        placement_group_strategy=args.get("strategy", "PACK"),
    ).bind(target=args.get("target"), draft=args.get("draft"), k=int(args.get("k", 2)), use_gpu=use_gpu,
           model_name=args.get("model_name", "ssd-default"), dtype=str(args.get("dtype", "auto")))


#: The default application: one replica, a GPU each for drafter and verifier (override with ``build_app``).
app = build_app({})
