"""The billion-parameter pair (Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling, ``ssd install-models --pair
qwen2.5-coder-1.5b``), fp32: greedy SSD equals transformers ``generate()`` token for token on held-out code
prompts, with the drafter running ahead (``auto`` picks it for this pair) and with the fan-out. ``-m slow``: about
7 minutes and 16 GB on 2 cores; skipped where the pair is not installed."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch

from spec_core.pairs import get_pair, missing_files, pair_paths

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(missing_files(get_pair("qwen2.5-coder-1.5b"))),
                                 reason="the qwen2.5-coder-1.5b pair is not installed"),
              pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or os.cpu_count() < 2,
                                 reason="needs two cores")]

NEW, N_PROMPTS = 32, 2


@pytest.fixture(scope="module")
def paths() -> dict[str, str]:
    return pair_paths(get_pair("qwen2.5-coder-1.5b"))


@pytest.fixture(scope="module")
def target(paths):
    from spec_core.config import ModelConfig
    from spec_core.models import load_runner

    return load_runner(ModelConfig(paths["target"], dtype="float32"))


@pytest.fixture(scope="module")
def prompts(paths) -> list[list[int]]:
    from spec_core.model_paths import resolve_model
    from spec_core.models import load_tokenizer
    from spec_core.prompts import code_prompts

    tok = load_tokenizer(resolve_model(paths["target"], weights=False))
    return [tok(p)["input_ids"] for p in code_prompts(N_PROMPTS)]


@pytest.fixture(scope="module")
def hf_greedy(paths, prompts) -> list[list[int]]:
    """transformers' own greedy tokens, from the GGUF's fp32 conversion; the model is freed before SSD loads."""
    from transformers import AutoModelForCausalLM

    from spec_core.model_paths import resolve_model

    hf = AutoModelForCausalLM.from_pretrained(resolve_model(paths["target"]), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, top_p=None, top_k=None,
                              temperature=None)
            out.append(gen[0, len(ids):].tolist())
    del hf
    return out


@pytest.mark.parametrize("strategy", ["auto", "fanout"])
def test_greedy_ssd_equals_transformers(paths, target, prompts, hf_greedy, strategy) -> None:
    from cluster.local_ssd import LocalSSD
    from spec_core.config import SamplingParams
    from spec_core.sequence import Sequence
    from spec_core.settings import ServiceConfig

    cfg = ServiceConfig(draft=paths["draft"], k=4, ssd_strategy=strategy, fixed_k=True, draft_dtype="float32",
                        max_num_seqs=2)
    with LocalSSD(target, cfg) as ssd:
        assert ssd.strategy == ("run-ahead" if strategy == "auto" else "fanout")
        seqs = [Sequence(str(i), ids, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
                for i, ids in enumerate(prompts)]
        for s in seqs:
            ssd.engine.add(s)
        ssd.engine.run()
        assert ssd.proposer.stats.rounds > 0
    for i, (seq, ref) in enumerate(zip(seqs, hf_greedy)):
        assert seq.output_ids == ref, f"prompt {i}"


def test_served_chat_uses_chatml(paths) -> None:
    """``ssd serve --pair qwen2.5-coder-1.5b`` (default dtype, the drafter running ahead) answers a chat request
    from the official client, greedy; the prompt it counted is the pair's ChatML rendering of the messages."""
    from conftest import start_served
    from openai import OpenAI

    from spec_core.model_paths import resolve_model
    from spec_core.models import load_tokenizer

    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    tok = load_tokenizer(resolve_model(paths["target"], weights=False))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")  # ChatML
    chatml = tok(text, add_special_tokens=False)["input_ids"]
    proc, info = start_served("--pair", "qwen2.5-coder-1.5b", timeout_s=600)
    try:
        with OpenAI(base_url=f"http://{info['verifier']['http_address']}/v1", api_key="unused", max_retries=0,
                    timeout=300) as client:
            out = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                                 temperature=0, max_tokens=48)
        assert out.usage.prompt_tokens == len(chatml)
        assert out.usage.completion_tokens > 0 and "def " in out.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGINT)  # ssd serve shuts its Ray down
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
