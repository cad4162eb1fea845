"""The real pair (SmolLM2-135M-Instruct and its distilled draft), fp32: the runner's logits match transformers',
and greedy AR, SD and SSD equal transformers ``generate()`` token for token on 8 code prompts and 8 chat prompts
(through the chat template), 64 tokens each. bf16 greedy agreement with fp32 is reported, not asserted."""

from __future__ import annotations

import json

import pytest
import torch

from spec_core import chat
from spec_core.prompts import chat_prompts, humaneval_prompts

NEW = 64


@pytest.fixture(scope="module")
def hf(real_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_pair["target"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pair(real_pair):
    from spec_core.config import ModelConfig
    from spec_core.models import load_pair

    return load_pair(ModelConfig(real_pair["target"]), ModelConfig(real_pair["draft"]))


@pytest.fixture(scope="module")
def prompts(pair) -> list[list[int]]:
    code = [chat.encode(pair.tokenizer, p) for p in humaneval_prompts(8)]
    chats = [chat.encode(pair.tokenizer, p) for p in chat_prompts(8)]
    return code + chats


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, top_p=None, top_k=None,
                              temperature=None)
            out.append(gen[0, len(ids):].tolist())
    return out


def test_runner_logits_match_transformers(hf, pair, prompts):
    target = pair.target
    for ids in (prompts[0], prompts[-1]):
        x = torch.tensor([ids])
        ours = target.forward(target.new_cache(1, len(ids)), x, torch.arange(len(ids))[None])
        with torch.no_grad():
            ref = hf(x).logits
        assert (ours - ref).abs().max().item() < 1e-4


def _batch(pair, prompts, mode: str, tmp_path, **kw) -> list[list[int]]:
    from spec_core.config import SamplingParams
    from verifier_service.batch import run_batch
    from verifier_service.batch_requests import BatchSettings

    rows = [(f"r{i}", ids, SamplingParams(max_new_tokens=NEW)) for i, ids in enumerate(prompts)]
    out = tmp_path / f"{mode}.jsonl"
    settings = BatchSettings(mode=mode, concurrency=8, k=kw.get("k", 4), draft_path=kw.get("draft_path"))
    run_batch(pair, rows, out, settings)
    return [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_equals_transformers_generate(pair, prompts, hf_greedy, real_pair, tmp_path, mode):
    got = _batch(pair, prompts, mode, tmp_path, k=4 if mode == "sd" else 2, draft_path=real_pair["draft"])
    for i, (a, b) in enumerate(zip(got, hf_greedy)):
        assert a == b, f"{mode}, prompt {i} ({'code' if i < 8 else 'chat'})"


def test_single_request_paths_equal_transformers(pair, prompts, hf_greedy):
    """The single-request AR and SD loops (``ssd generate``'s path) on one code and one chat prompt."""
    from spec_core.api import Generator
    from spec_core.config import SamplingParams

    gen = Generator.from_pair(pair, k=4)
    for i in (0, 8):
        for mode in ("ar", "sd"):
            res = gen.generate(prompts[i], SamplingParams(max_new_tokens=NEW), mode=mode)
            assert res.token_ids == hf_greedy[i], (mode, i)


def test_bf16_greedy_agreement_is_reported(real_pair, prompts, hf_greedy, report, tmp_path):
    from spec_core.config import ModelConfig, native_bf16
    from spec_core.models import load_pair

    bf16 = load_pair(ModelConfig(real_pair["target"], dtype="bfloat16"), None)
    where = "native"
    if not native_bf16():  # emulated (AVX2-only CPUs): ~7x slower than fp32, so a quarter of the prompts
        prompts, hf_greedy, where = prompts[::4], hf_greedy[::4], "emulated on this CPU: every 4th prompt"
    same, prefix, total, first = 0, 0, 0, 0
    for out, ref in zip(_batch(bf16, prompts, "ar", tmp_path), hf_greedy):
        same += out == ref
        n = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        prefix += n
        total += len(ref)
        first += out[0] == ref[0]
    report(f"bf16 vs fp32 greedy (real target, {len(prompts)} prompts x {NEW} tokens): {same}/{len(prompts)} "
           f"identical, matching prefix {prefix}/{total} tokens ({prefix / total:.3f}); bf16 {where}")
    # Exact agreement is reported, not asserted (bf16 is a different numeric model); a broken bf16 path would
    # not even agree on the first token.
    assert first >= 0.75 * len(prompts), first
