"""Chat on the real pair: the template's ids, stopping at the end-of-turn token, text without special tokens;
through the API, `ssd generate --chat/--messages`, `ssd batch` messages and the gRPC codec."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from protos import codec
from spec_core import chat
from spec_core.chat import ChatPrompt
from spec_core.config import SamplingParams

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a primary color."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write a haiku about rain."}],
]


@pytest.fixture(scope="module")
def tokenizer(real_pair):
    from spec_core.models import load_tokenizer

    return load_tokenizer(real_pair["target"])


@pytest.fixture(scope="module")
def generator(real_pair):
    from spec_core.config import ModelConfig
    from verifier_service.api import Generator

    return Generator(ModelConfig(real_pair["target"]), ModelConfig(real_pair["draft"]), k=4)


@pytest.mark.parametrize("messages", MESSAGES)
def test_prompt_ids_equal_apply_chat_template(tokenizer, messages):
    ref = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = chat.encode(tokenizer, ChatPrompt.of(messages))
    assert ids == list(ref["input_ids"])
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_plain_prompt_is_encoded_as_the_tokenizer_does(tokenizer):
    for text in ("hi", "def f(x):\n    return x", "<|im_start|>user"):
        assert chat.encode(tokenizer, text) == tokenizer(text)["input_ids"]


def test_eos_ids_include_generation_config_and_tokenizer(generator, tokenizer):
    assert 2 in generator.pair.eos_ids  # <|im_end|>: config, generation_config and tokenizer all say so
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_stream_stops_at_end_of_turn_and_text_has_no_special_tokens(generator, mode):
    res = generator.generate(ChatPrompt.of(MESSAGES[0]), SamplingParams(max_new_tokens=48), mode=mode)
    assert res.finish_reason == "stop"
    assert res.token_ids[-1] == 2 and 2 not in res.token_ids[:-1]
    assert "Paris" in res.text
    assert "<|im_end|>" not in res.text and "<|im_start|>" not in res.text


def test_messages_validation():
    with pytest.raises(ValueError, match="role"):
        ChatPrompt.of([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="content"):
        ChatPrompt.of([{"role": "user"}])
    with pytest.raises(ValueError, match="non-empty"):
        ChatPrompt.of([])


def test_messages_travel_through_the_codec():
    prompt = ChatPrompt.of(MESSAGES[2])
    req = codec.params_to_request(prompt, SamplingParams(max_new_tokens=5))
    back, params = codec.request_to_params(codec.pb.GenerateRequest.FromString(req.SerializeToString()))
    assert back == prompt and params.max_new_tokens == 5
    both = codec.pb.GenerateRequest(prompt="x")
    both.messages.add(role="user", content="y")
    with pytest.raises(ValueError, match="exactly one"):
        codec.request_to_params(both)


def _ssd(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "ssd_cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_chat_and_messages_file(tmp_path, generator):
    expected = generator.generate(ChatPrompt.of(MESSAGES[1]), SamplingParams(max_new_tokens=24), mode="ar")
    f = tmp_path / "messages.json"
    f.write_text(json.dumps(MESSAGES[1]))
    out = json.loads(_ssd("generate", "--messages", str(f), "--mode", "sd", "--k", "4", "--max-new-tokens", "24",
                          "--json", "--threads", "1", "--dtype", "float32").stdout)
    assert out["token_ids"] == expected.token_ids and out["text"] == expected.text
    one = json.loads(_ssd("generate", "--chat", MESSAGES[0][0]["content"], "--mode", "ar", "--max-new-tokens",
                          "24", "--json", "--threads", "1", "--dtype", "float32").stdout)
    ref = generator.generate(ChatPrompt.of(MESSAGES[0]), SamplingParams(max_new_tokens=24), mode="ar")
    assert one["token_ids"] == ref.token_ids
    bad = _ssd("generate", "--chat", "x", "--prompt", "y")
    assert bad.returncode == 2 and bad.stderr.startswith("ssd: error:")
    f.write_text(json.dumps([{"role": "user"}]))
    bad = _ssd("generate", "--messages", str(f))
    assert bad.returncode == 2 and "content" in bad.stderr


def test_batch_lines_with_messages(tmp_path, generator):
    rows = [{"id": "c0", "messages": MESSAGES[0], "max_new_tokens": 16},
            {"id": "p0", "prompt": "def add(a, b):", "max_new_tokens": 8, "ignore_eos": True}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _ssd("batch", "--input", str(src), "--output", str(dst), "--mode", "sd", "--k", "4", "--threads", "1",
                "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    ref = generator.generate(ChatPrompt.of(MESSAGES[0]), SamplingParams(max_new_tokens=16), mode="ar")
    assert out[0]["token_ids"] == ref.token_ids and out[0]["text"] == ref.text
    assert out[0]["finish_reason"] == "stop"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": 3}]}) + "\n")
    bad = _ssd("batch", "--input", str(src), "--output", str(dst))
    assert bad.returncode == 2 and "line 1" in bad.stderr and "content" in bad.stderr
