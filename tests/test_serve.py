"""Ray Serve: two replicas, each with its own drafter–verifier pair; gRPC through Serve's proxy; OpenAI HTTP; a bearer
token on both (the one configuration's `auth-token-file`)."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest
from local_ports import free_ports

from protos import codec
from protos.ssd.v1 import ssd_pb2 as pb
from protos.ssd.v1 import ssd_pb2_grpc
from spec_core.config import SamplingParams

PROMPT = "class Stack:\n    def push(self, item):\n"
TOKEN = "serve-app-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
#: gRPC through Serve's proxy: the application's name and the bearer token (checked by each replica's verifier)
GRPC_META = (("application", "ssd"), ("authorization", f"Bearer {TOKEN}"))


@pytest.fixture(scope="module")
def serve_app(ray_session, toy_pair, tmp_path_factory):
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from cluster.serve_app import build_app

    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN)
    grpc_port, http_port = free_ports(2)
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=http_port),
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[
                    "protos.ssd.v1.ssd_pb2_grpc.add_GenerationServicer_to_server"]))
    handle = serve.run(build_app({"gpu": "no", "num-replicas": 2, "pair_cpus": 0.3, "replica_cpus": 0.2,
                                  "target": toy_pair["target"], "draft": toy_pair["draft"],
                                  "dtype": "float32", "auth-token-file": str(token_file)}),
                       name="ssd", route_prefix="/")
    yield handle, grpc_port, http_port
    serve.shutdown()


def test_two_replicas_each_with_own_pair(serve_app) -> None:
    from ray import serve

    status = serve.status().applications["ssd"].deployments["SSDServer"]
    assert status.status == "HEALTHY"
    assert status.replica_states.get("RUNNING") == 2


def test_grpc_through_serve_proxy_equals_ar(serve_app, greedy_reference) -> None:
    _, grpc_port, _ = serve_app
    req = codec.params_to_request(PROMPT, SamplingParams(max_new_tokens=24, ignore_eos=True))
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = ssd_pb2_grpc.GenerationStub(ch)
        responses = list(stub.Generate(req, metadata=GRPC_META, timeout=300))
    deltas = [r.delta for r in responses if r.WhichOneof("kind") == "delta"]
    final = responses[-1].final
    assert list(final.token_ids) == greedy_reference(PROMPT, 24)
    assert [t for d in deltas for t in d.token_ids] == list(final.token_ids)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = ssd_pb2_grpc.GenerationStub(ch)
        stats = stub.GetStats(pb.StatsRequest(), metadata=GRPC_META, timeout=60)
        with pytest.raises(grpc.RpcError) as info:  # the replica passes the caller's token on; none is refused
            stub.GetStats(pb.StatsRequest(), metadata=(("application", "ssd"),), timeout=60)
    assert stats.mode == "ssd" and info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_openai_completions_stream_and_models(serve_app, greedy_reference) -> None:
    _, _, http_port = serve_app
    base = f"http://127.0.0.1:{http_port}"
    with pytest.raises(urllib.error.HTTPError) as info:  # the token first, as `ssd serve --http-port` does
        urllib.request.urlopen(f"{base}/v1/models", timeout=60)
    assert info.value.code == 401 and json.load(info.value)["error"]["code"] == "invalid_api_key"
    with urllib.request.urlopen(urllib.request.Request(f"{base}/v1/models", headers=BEARER), timeout=60) as r:
        assert json.load(r)["data"][0]["id"] == "toy-target"  # the target's name
    body = {"model": "toy-target", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **BEARER})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    body["stream"] = False
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **BEARER})
    with urllib.request.urlopen(req, timeout=300) as r:
        full = json.load(r)
    assert full["choices"][0]["text"] == text and full["usage"]["completion_tokens"] == 12
    bad = urllib.request.Request(f"{base}/v1/completions",
                                 data=json.dumps({"model": "toy-target", "prompt": "x", "top_p": 3}).encode(),
                                 headers={"Content-Type": "application/json", **BEARER})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(bad, timeout=60)
    assert info.value.code == 400 and "top_p" in json.load(info.value)["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as info:  # errors in OpenAI's shape, as ssd serve's
        urllib.request.urlopen(urllib.request.Request(f"{base}/v1/nothing", headers=BEARER), timeout=60)
    assert info.value.code == 404 and json.load(info.value)["error"]["message"]
    big = urllib.request.Request(f"{base}/v1/completions", data=b"x" * (5 * 2**20),
                                 headers={"Content-Type": "application/json", **BEARER})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(big, timeout=60)
    assert info.value.code == 413 and json.load(info.value)["error"]["code"] == "request_too_large"


def test_eight_concurrent_openai_streams_run_at_once(serve_app, greedy_reference) -> None:
    """2 replicas, 8 concurrent streams through the official client: every stream has its first token before
    any stream finishes (none waits behind Serve's default limit of 5 per replica), and each equals AR."""
    import threading
    import time

    from openai import OpenAI

    _, _, http_port = serve_app
    prompts = [f"def task_{i}(x):\n    " for i in range(8)]
    first, done, texts = {}, {}, {}

    def one(i: int) -> None:
        with OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=TOKEN, max_retries=0) as client:
            parts = []
            for c in client.completions.create(model="toy-target", prompt=prompts[i], max_tokens=48, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
                first.setdefault(i, time.monotonic())
                parts.append(c.choices[0].text)
            done[i], texts[i] = time.monotonic(), "".join(parts)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(done) == 8
    assert max(first.values()) < min(done.values())
    from spec_core.model_paths import toy_pair
    from spec_core.models import load_tokenizer

    tok = load_tokenizer(toy_pair()["target"])
    for i, p in enumerate(prompts):
        assert texts[i] == tok.decode(greedy_reference(p, 48), skip_special_tokens=True)
