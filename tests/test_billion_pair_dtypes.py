"""The billion-parameter pair's CPU dtypes against fp32 (``-m slow``; skipped where the pair is not installed):
greedy agreement with fp32 of ``gguf`` (the files' own Q4_K/Q6_K and Q5_0/Q8_0 matrices, exact) and of ``int4``
(re-quantized to Q4_1) on 4 held-out code prompts and 2 chat prompts, 32 tokens each, for the target and for the
draft, reported; and SD over gguf equals gguf's own AR. About 10 minutes and 8 GB (one model at a time: the fp32
target is 7 GB) on 2 cores."""

from __future__ import annotations

import gc

import pytest

from spec_core.backends.cpu import cpu_kernels
from spec_core.pairs import get_pair, missing_files, pair_paths

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(missing_files(get_pair("qwen2.5-coder-1.5b"))),
                                 reason="the qwen2.5-coder-1.5b pair is not installed"),
              pytest.mark.skipif(cpu_kernels.kquant_gemm() is None, reason="dtype gguf needs the K-quant kernels")]

NEW = 32


@pytest.fixture(scope="module")
def paths() -> dict[str, str]:
    return pair_paths(get_pair("qwen2.5-coder-1.5b"))


@pytest.fixture(scope="module")
def tokenizer(paths):
    from spec_core.models import load_tokenizer

    return load_tokenizer(paths["target"])


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    from spec_core import chat
    from spec_core.prompts import chat_prompts, code_prompts

    return ([tokenizer(p)["input_ids"] for p in code_prompts(4)]
            + [chat.encode(tokenizer, p) for p in chat_prompts(2)])


def _greedy(path: str, dtype: str, prompts, tokenizer, mode: str = "ar", draft: str | None = None) -> list[list[int]]:
    """Greedy tokens of the model at ``path`` in ``dtype`` (AR, or SD with ``draft`` in the same dtype), the
    runners freed before returning (the fp32 target alone is 7 GB)."""
    from spec_core.config import ModelConfig, SamplingParams
    from spec_core.models import LoadedPair, load_runner
    from verifier_service.api import Generator

    target = load_runner(ModelConfig(path, dtype))
    small = load_runner(ModelConfig(draft, dtype), reference=False) if draft else None
    gen = Generator.from_pair(LoadedPair(target, small, tokenizer, ()), k=4)
    out = [gen.generate(ids, SamplingParams(max_new_tokens=NEW, ignore_eos=True), mode=mode).token_ids
           for ids in prompts]
    del gen, target, small
    gc.collect()
    return out


def _agreement(outs, refs) -> str:
    same = sum(o == r for o, r in zip(outs, refs))
    prefix = sum(next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, refs))
    total = sum(len(r) for r in refs)
    return f"{same}/{len(refs)} identical, prefix {prefix}/{total} ({prefix / total:.3f})"


@pytest.mark.parametrize("model", ["target", "draft"])
def test_gguf_and_int4_greedy_agreement_with_fp32_is_reported(model, paths, prompts, tokenizer, report):
    ref = _greedy(paths[model], "float32", prompts, tokenizer)
    rows = {dtype: _greedy(paths[model], dtype, prompts, tokenizer) for dtype in ("gguf", "int4")}
    report(f"qwen2.5-coder-1.5b {model}, {len(prompts)} prompts x {NEW} greedy tokens against fp32: "
           + "; ".join(f"{dtype} {_agreement(outs, ref)}" for dtype, outs in rows.items()))
    for outs in rows.values():  # a broken path would not agree on the first tokens
        assert sum(o[0] == r[0] for o, r in zip(outs, ref)) >= 0.75 * len(ref)


def test_sd_over_the_files_formats_equals_their_ar(paths, prompts, tokenizer):
    """Batch-invariant kernels: SD with the gguf draft verifies K + 1 rows and still gives gguf AR's tokens."""
    ar = _greedy(paths["target"], "gguf", prompts[:2], tokenizer)
    assert _greedy(paths["target"], "gguf", prompts[:2], tokenizer, "sd", paths["draft"]) == ar
