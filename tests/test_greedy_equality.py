"""Greedy SD == greedy AR == transformers ``generate(do_sample=False)``, token for token. Never waived."""

from __future__ import annotations

import pytest
import torch
from reference_decoding import generate_ar, generate_sd
from transformers import AutoModelForCausalLM

from spec_core.config import SamplingParams
from spec_core.models import load_tokenizer
from spec_core.prompts import humaneval_prompts
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    # An explicit all-ones mask: otherwise transformers treats prompt tokens equal to pad_token_id as padding.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def top2_gap_report(model, prompt_ids: list[int], ref: list[int], got: list[int]) -> str:
    """At the first mismatch, the reference's top-2 logit gap (tells a tie from a bug)."""
    i = next(j for j, (a, b) in enumerate(zip(ref, got)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ref[:i]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return f"first mismatch at token {i}: ref {ref[i]} vs {got[i]}; reference top-2 logit gap {float(top[0] - top[1]):.3e}"


def check_all_equal(model, prompt_ids, ref, outputs: dict[str, list[int]]) -> None:
    for name, got in outputs.items():
        if got != ref:
            pytest.fail(f"{name} != transformers greedy: " + top2_gap_report(model, prompt_ids, ref, got))


def _run(target, draft, prompt_ids, n, k):
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    ar = Sequence("ar", prompt_ids, params)
    generate_ar(target, ar)
    sd = Sequence("sd", prompt_ids, params)
    generate_sd(target, draft, sd, k)
    return ar.output_ids, sd.output_ids


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_random_configs(tiny_models, family):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models[family]), dtype=torch.float32).eval()
    target, draft = ModelRunner(tiny_models[family]), ModelRunner(tiny_models[f"{family}-draft"])
    self_draft = ModelRunner(tiny_models[family])
    gen = torch.Generator().manual_seed(7)
    for trial in range(6):
        prompt = torch.randint(0, 256, (3 + 5 * trial,), generator=gen).tolist()
        ref = hf_greedy(model, prompt, 48)
        ar, sd = _run(target, draft, prompt, 48, k=1 + trial)
        _, sd_self = _run(target, self_draft, prompt, 48, k=4)
        check_all_equal(model, prompt, ref, {"AR": ar, "SD": sd, "SD(self-draft)": sd_self})


@pytest.mark.parametrize("n", [10, pytest.param(20, marks=pytest.mark.slow)])
def test_toy_pair_humaneval(toy_pair, n):
    """The first ``n`` HumanEval prompts × 64 tokens with the toy pair."""
    tok = load_tokenizer(toy_pair["target"])
    model = AutoModelForCausalLM.from_pretrained(toy_pair["target"], dtype=torch.float32).eval()
    target, draft = ModelRunner(toy_pair["target"]), ModelRunner(toy_pair["draft"])
    for prompt in humaneval_prompts(n):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ref = hf_greedy(model, ids, 64)
        ar, sd = _run(target, draft, ids, 64, k=5)
        check_all_equal(model, ids, ref, {"AR": ar, "SD": sd})
