"""OpenAI-compatible HTTP from ``ssd serve --http-port`` (the real pair, fp32, SSD), through the official ``openai``
client, ``curl -N`` and raw HTTP: chat and completions, streaming and not, usage, stop strings, seeds, logprobs,
errors in OpenAI's shape, and ``/health`` and ``/metrics`` on the same port."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest

QUESTION = "What is the capital of France?"
CODE = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def http(served) -> str:
    _, info = served
    return f"http://{info['verifier']['http_address']}"


@pytest.fixture(scope="module")
def model(served) -> str:
    return served[1]["verifier"]["model_name"]


@pytest.fixture(scope="module")
def client(http):
    from openai import OpenAI

    with OpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(real_pair):
    from spec_core.models import load_tokenizer

    return load_tokenizer(real_pair["target"])


def _post(url: str, body: bytes | str, headers: dict | None = None) -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_lists_the_served_name(client, model) -> None:
    assert model == "SmolLM2-135M-Instruct"
    assert [m.id for m in client.models.list().data] == [model]


def test_chat_greedy_equals_the_targets_own_and_streams_the_same(client, model, real_reference, tokenizer) -> None:
    from spec_core.chat import ChatPrompt

    messages = [{"role": "user", "content": QUESTION}]
    ref = real_reference(ChatPrompt.of(messages), 32)
    ref = ref[: ref.index(2) + 1] if 2 in ref else ref  # up to the end of turn
    res = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32)
    choice = res.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(ref, skip_special_tokens=True)
    assert "Paris" in choice.message.content
    assert choice.finish_reason == ("stop" if ref[-1] == 2 else "length")
    assert res.usage.completion_tokens == len(ref) and res.usage.prompt_tokens > 10
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == res.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_stream_and_stop_string(client, model, real_reference, tokenizer) -> None:
    ref = real_reference(CODE, 24)
    res = client.completions.create(model=model, prompt=CODE, temperature=0, max_tokens=24,
                                    extra_body={"ignore_eos": True})
    assert res.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == 24
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=CODE, temperature=0, max_tokens=24, stream=True, extra_body={"ignore_eos": True})
        if c.choices)
    assert streamed == res.choices[0].text
    stop = res.choices[0].text.strip().split()[1]  # a word the greedy answer reaches
    cut = client.completions.create(model=model, prompt=CODE, temperature=0, max_tokens=24, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert res.choices[0].text.startswith(cut.choices[0].text)


def test_seeded_sampling_is_reproducible_and_n_gives_choices(client, model) -> None:
    def once(n: int = 1):
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a color."}],
                                              temperature=0.8, top_p=0.95, seed=1234, max_tokens=12, n=n,
                                              extra_body={"top_k": 40})

    a, b = once(), once()
    assert a.choices[0].message.content == b.choices[0].message.content
    two = once(2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.completion_tokens >= 2


def test_logprobs_with_token_strings(client, model, tokenizer) -> None:
    res = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                         temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5
    assert "".join(e.token for e in content) == res.choices[0].message.content
    comp = client.completions.create(model=model, prompt=CODE, temperature=0, max_tokens=5, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == comp.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) == 2 for t in lp.top_logprobs)


def test_unknown_model_is_openais_404_and_extras_are_tolerated(client, model) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert err.value.status_code == 404 and "gpt-4o" in err.value.message
    assert err.value.body["code"] == "model_not_found"
    res = client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"some_vendor_field": 1})
    assert res.usage.completion_tokens >= 1


def test_model_may_be_left_out_as_vllm_allows(http, model) -> None:
    status, obj = _post(f"{http}/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "ignore_eos": True}))
    assert status == 200 and obj["model"] == model and obj["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body, param", [
    ("{not json", None),
    (json.dumps({"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
     "temperature"),
    (json.dumps({"model": "M", "messages": "hi"}), "messages"),
    (json.dumps({"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 9}), None),
    (json.dumps({"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}), "max_tokens"),
    (json.dumps({"model": "M", "messages": [{"role": "user", "content": "hi"}], "top_p": 2}), "top_p"),
    (json.dumps({"model": "M", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 1}),
     "presence_penalty"),
    (json.dumps([1, 2]), None),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(http, model, client, body, param) -> None:
    status, obj = _post(f"{http}/v1/chat/completions", body.replace('"M"', json.dumps(model)))
    assert 400 <= status < 500, obj
    assert set(obj["error"]) == {"message", "type", "param", "code"} and obj["error"]["message"]
    if param:
        assert param in obj["error"]["message"]
    assert client.completions.create(model=model, prompt="Hi", max_tokens=1).usage.completion_tokens == 1


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_sse_stream_parses_and_ends_with_done(http, model) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    out = subprocess.run(["curl", "-sN", f"{http}/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=300, check=True).stdout
    events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] >= 1


def test_health_and_metrics_on_the_http_port(http, client, model) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{http}/health", timeout=30) as r:
        assert r.status == 200
    client.completions.create(model=model, prompt="Hello", max_tokens=2)
    with urllib.request.urlopen(f"{http}/metrics", timeout=30) as r:
        families = {f.name for f in text_string_to_metric_families(r.read().decode())}
    assert families  # parses, and the verifier's metrics are there
