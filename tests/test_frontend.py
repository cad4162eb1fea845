"""The verifier's in-process front end (:mod:`verifier_service.frontend`) on the toy target in AR mode: streaming
and results, refusals with their status names, per-client slots, cancellation, the protobuf codec of its types,
the gRPC-stub backend, and the ``--http-port`` path building no loopback gRPC channel."""

from __future__ import annotations

import asyncio
import http.client
import json

import grpc
import pytest

from protos.ssd.v1 import ssd_pb2_grpc
from spec_core.config import ModelConfig, SamplingParams, SpeculationConfig
from verifier_service.frontend import Caller, Chunk, FrontEnd, GenerationError, GenerationRequest, Result
from verifier_service.frontend_pb import event_from_pb, event_to_pb, request_from_pb, request_to_pb
from verifier_service.generation_backend import GenerationBackend, GrpcBackend
from verifier_service.server import VerifierServer, VerifierServerConfig

MAX_MODEL_LEN = 64
ALICE, BOB = Caller(address="10.0.0.1"), Caller("Bearer bob")


def _record_channels(monkeypatch) -> list:
    made: list = []
    for name in ("insecure_channel", "secure_channel"):
        real = getattr(grpc.aio, name)
        monkeypatch.setattr(grpc.aio, name, lambda *a, _real=real, **k: made.append(a) or _real(*a, **k))
    return made


@pytest.fixture(scope="module")
def served(toy_pair):
    """An AR verifier with HTTP, started while every ``grpc.aio`` channel made is recorded."""
    cfg = VerifierServerConfig(ModelConfig(toy_pair["target"]), spec=SpeculationConfig("ar", 0), http_port=0,
                               served_model_name="toy", max_model_len=MAX_MODEL_LEN, max_streams_per_client=2,
                               stats_log_interval_s=None)
    server = VerifierServer(cfg)
    with pytest.MonkeyPatch.context() as mp:
        made = _record_channels(mp)
        server.start()
    yield server, made
    server.stop()


def _greedy(n: int, **kw) -> GenerationRequest:
    return GenerationRequest("def f(x):", SamplingParams(max_new_tokens=n, ignore_eos=True), **kw)


async def _drain(backend, handle) -> list:
    try:
        return [ev async for ev in backend.stream(handle)]
    finally:
        backend.cancel(handle)


async def _one(backend, request: GenerationRequest, caller: Caller = ALICE) -> Result:
    handle = await backend.submit(request, caller)
    try:
        return await backend.result(handle)
    finally:
        backend.cancel(handle)


async def _settled(server: VerifierServer) -> bool:
    """Whether the engine holds no request (waits for the engine thread, bounded)."""
    for _ in range(500):
        if not server.engine_loop.num_admitted and server.stats()["kv_usage"] == 0.0:
            return True
        await asyncio.sleep(0.01)
    return False


def test_chunks_concatenate_to_the_result_and_slots_come_back(served) -> None:
    server, _ = served
    front: FrontEnd = server.frontend
    assert isinstance(front, GenerationBackend)

    async def run():
        events = await _drain(front, await front.submit(_greedy(12, request_id="mine"), ALICE))
        alone = await front.result(ticket := await front.submit(_greedy(12), ALICE))
        front.cancel(ticket)
        return events, alone

    events, alone = asyncio.run(run())
    chunks, final = events[:-1], events[-1]
    assert chunks and all(isinstance(c, Chunk) for c in chunks) and isinstance(final, Result)
    assert [t for c in chunks for t in c.token_ids] == final.token_ids and len(final.token_ids) == 12
    assert "".join(c.text for c in chunks) == final.text
    assert final.request_id == "mine" and final.finish_reason == "length" and final.mode == "ar"
    assert alone.token_ids == final.token_ids and alone.request_id.startswith("req-")
    assert front.streams_by_client == {}


@pytest.mark.parametrize("request_, status, words", [
    (GenerationRequest([], SamplingParams()), "INVALID_ARGUMENT", "empty"),
    (_greedy(MAX_MODEL_LEN), "INVALID_ARGUMENT", "context"),
    (GenerationRequest([10 ** 6], SamplingParams()), "INVALID_ARGUMENT", "vocabulary"),
])
def test_refusals_carry_a_status_name(served, request_, status, words) -> None:
    front: FrontEnd = served[0].frontend
    with pytest.raises(GenerationError) as err:
        asyncio.run(front.submit(request_, ALICE))
    assert err.value.status == status and words in err.value.message
    assert front.streams_by_client == {}


def test_a_default_max_new_tokens_is_capped_to_the_context(served) -> None:
    front: FrontEnd = served[0].frontend
    request = GenerationRequest([7] * (MAX_MODEL_LEN - 5), SamplingParams(ignore_eos=True), default_max_new_tokens=16)
    result = asyncio.run(_one(front, request))
    assert len(result.token_ids) == 5 and result.finish_reason == "length"


def test_per_client_slots_and_cancel_frees_the_request(served) -> None:
    server, _ = served
    front: FrontEnd = server.frontend

    async def run():
        long = [await front.submit(_greedy(MAX_MODEL_LEN - 16), ALICE) for _ in range(2)]
        with pytest.raises(GenerationError) as err:
            await front.submit(_greedy(2), ALICE)
        assert err.value.status == "RESOURCE_EXHAUSTED" and "in flight" in err.value.message
        other = await _one(front, _greedy(2), BOB)  # another client is counted apart
        http_alice = await _one(front, _greedy(2), Caller(address="10.0.0.1", http=True))
        first = await anext(front.stream(long[0]))
        for t in long:
            front.cancel(t)
            front.cancel(t)  # idempotent: the slot is given back once
        return other, http_alice, first, await _settled(server)

    other, http_alice, first, settled = asyncio.run(run())
    assert len(other.token_ids) == 2 and len(http_alice.token_ids) == 2 and isinstance(first, Chunk)
    assert settled and front.streams_by_client == {} and not server.engine_loop.active


def test_caller_keys() -> None:
    assert Caller(address="1.2.3.4").key == "peer:1.2.3.4"
    assert Caller(address="1.2.3.4", http=True).key == "peer:http:1.2.3.4"
    assert Caller("Bearer x", "1.2.3.4").key == Caller("Bearer x", "5.6.7.8").key != Caller("Bearer y").key


def test_the_protobuf_codec_round_trips() -> None:
    from verifier_service.frontend import PositionLogprobs, RequestStats, TokenLogprob

    req = GenerationRequest("hi", SamplingParams(temperature=0.5, seed=3, stop=("x",)), "id", default_max_new_tokens=9)
    wire = request_to_pb(req)
    assert not wire.HasField("max_new_tokens") and request_from_pb(wire, 9) == req
    own = GenerationRequest("hi", SamplingParams(max_new_tokens=7))
    assert request_from_pb(request_to_pb(own)) == own
    pos = [PositionLogprobs(TokenLogprob(5, "a", -0.5), [TokenLogprob(5, "a", -0.5), TokenLogprob(6, "b", -1.0)])]
    res = Result("id", "ssd", [5], "a", "abort", 3, [-0.5], pos, RequestStats(ttft_s=0.25, num_rounds=2,
                                                                              acceptance_by_position=[1.0, 0.5]))
    assert event_from_pb(event_to_pb(res)) == res
    chunk = Chunk([5], "a", [-0.5], pos)
    assert event_from_pb(event_to_pb(chunk)) == chunk


def test_the_grpc_stub_backend_answers_as_the_front_end(served) -> None:
    server, _ = served

    async def run():
        channel = grpc.aio.insecure_channel(server.address)
        try:
            backend = GrpcBackend(lambda: ssd_pb2_grpc.GenerationStub(channel))
            events = await _drain(backend, await backend.submit(_greedy(6), ALICE))
            with pytest.raises(GenerationError) as err:
                await _one(backend, _greedy(MAX_MODEL_LEN))
            return events, await _one(server.frontend, _greedy(6)), err.value
        finally:
            await channel.close()

    events, direct, err = asyncio.run(run())
    assert events[-1].token_ids == direct.token_ids and events[-1].text == direct.text
    assert err.status == "INVALID_ARGUMENT" and "context" in err.message
    assert server.frontend.streams_by_client == {}


def test_http_calls_the_front_end_in_process(served, monkeypatch) -> None:
    """``--http-port`` serves through the in-process front end: no ``grpc.aio`` channel is made, at start or per
    request, and the HTTP client is its own client for the limits."""
    server, made_at_start = served
    assert server.http_handlers.backend is server.frontend
    made = _record_channels(monkeypatch)
    host, port = server.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "toy", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    answer = json.loads(r.read())
    conn.request("GET", "/health")
    health = conn.getresponse()
    health.read()
    conn.close()
    assert r.status == 200 and [c["index"] for c in answer["choices"]] == [0, 1], answer
    assert answer["usage"]["completion_tokens"] == 8 and health.status == 200
    assert made_at_start == [] and made == []
    assert server.frontend.streams_by_client == {}  # both choices ended before the answer was sent


def test_an_http_port_in_use_is_an_error_and_the_shared_loop_lives_on() -> None:
    import socket
    import threading

    from verifier_service.openai_http import HttpServer, OpenAIHandlers, create_app

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        app = create_app(OpenAIHandlers(lambda: None, ["toy"]))
        with pytest.raises(RuntimeError, match="did not start"):
            HttpServer(app, "127.0.0.1", busy.getsockname()[1]).start(loop)
        assert asyncio.run_coroutine_threadsafe(asyncio.sleep(0, "alive"), loop).result(10) == "alive"
    finally:
        busy.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
