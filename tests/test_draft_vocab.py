"""A draft with a reduced output vocabulary (token_map.json) stays exact: its q is zero outside the map and the
verifier uses that q. Greedy SD equals AR; at T = 0.8 the real SD loop (continuous-batching verifier + batched
drafter) follows the target's distribution (chi-square), and the negative control (q renormalised over the full
vocabulary while drafting from the map) fails the same test with the same seeds and sample size."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import save_tiny_model
from test_engine import ar_reference, make_engine
from test_ssd_distribution import TEMP, exact_pairs, min_pvalue

from spec_core.config import SamplingParams
from spec_core.draft_engine import BatchDrafter, DraftConfig
from spec_core.runner import ModelRunner
from spec_core.sampling import request_probs, sample_from_probs
from spec_core.sequence import Sequence

N = 3000
VOCAB = 12
PROMPT = [3, 1, 4, 1, 5]
MAP = [0, 1, 2, 3, 5, 7, 8, 10]  # 8 of the 12 ids


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("vocabmap")
    target = save_tiny_model(base / "t", "llama", 31, vocab_size=VOCAB)
    full = save_tiny_model(base / "d", "llama", 32, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    mapped = base / "d-map"
    shutil.copytree(full, mapped)
    (mapped / "token_map.json").write_text(json.dumps(MAP))
    return ModelRunner(target), ModelRunner(full), ModelRunner(mapped)


def test_mapped_logits_are_the_full_heads_inside_and_minus_inf_outside(models):
    _, full, mapped = models
    x = torch.tensor([PROMPT])
    pos = torch.arange(len(PROMPT))[None]
    a = full.forward(full.new_cache(1, 16), x, pos)
    b = mapped.forward(mapped.new_cache(1, 16), x, pos)
    inside = torch.zeros(VOCAB, dtype=torch.bool)
    inside[MAP] = True
    assert torch.allclose(a[..., inside], b[..., inside], atol=1e-5)
    assert torch.isinf(b[..., ~inside]).all() and (b[..., ~inside] < 0).all()
    q = request_probs(b[:, -1:], [SamplingParams(temperature=TEMP)])
    assert float(q[..., ~inside].abs().sum()) == 0.0


def test_bad_token_map_is_refused(models, tmp_path):
    from spec_core.arch import load_token_map

    (tmp_path / "token_map.json").write_text(json.dumps([3, 1, 2]))
    with pytest.raises(ValueError, match="ascending"):
        load_token_map(tmp_path, VOCAB)
    (tmp_path / "token_map.json").write_text(json.dumps([0, VOCAB]))
    with pytest.raises(ValueError, match="ascending"):
        load_token_map(tmp_path, VOCAB)


def test_greedy_sd_with_a_mapped_draft_equals_ar(models):
    target, _, mapped = models
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (3 + 2 * i,), generator=gen).tolist() for i in range(4)]
    engine = make_engine(target, mapped, k=3)
    seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=24, ignore_eos=True)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    engine.run()
    for s, p in zip(seqs, prompts):
        assert s.output_ids == ar_reference(target, p, 24)


class FullVocabQDrafter(BatchDrafter):
    """Negative control: samples from the map-restricted distribution, but ships q renormalised over the full
    vocabulary (the head's softmax over every id), which is not the distribution the tokens came from."""

    def __init__(self, full_runner: ModelRunner, config: DraftConfig, token_map: list[int]) -> None:
        super().__init__(full_runner, config)
        self.inside = torch.zeros(full_runner.vocab_size, dtype=torch.bool)
        self.inside[token_map] = True

    def _sampler(self, seqs):
        def sample(rows, logits, width, root):
            sub = [seqs[i] for i in rows]
            q_full = request_probs(logits, [s.params for s in sub])
            q_map = q_full * self.inside
            out = []
            for j, seq in enumerate(sub):
                src = q_map[j, :1].expand(width, -1) if root else q_map[j, :width]
                shipped = q_full[j, :1].expand(width, -1) if root else q_full[j, :width]
                out.append((sample_from_probs(src, seq.uniforms(width)).tolist(), shipped))
            return out

        return sample


def _sd_samples(target: ModelRunner, drafter: BatchDrafter) -> torch.Tensor:
    from verifier_service.engine import EngineConfig, VerifierEngine
    from verifier_service.scheduler import SchedulerConfig

    engine = VerifierEngine(target, EngineConfig(4096, 8, SchedulerConfig(max_num_seqs=256, max_spec_nodes=3),
                                                 sampling="residual"),  # the q rows under test
                            drafter=drafter, k=3)
    seqs = [Sequence(str(i), PROMPT, SamplingParams(temperature=TEMP, seed=i, max_new_tokens=4, ignore_eos=True))
            for i in range(N)]
    for s in seqs:
        engine.add(s)
    engine.run()
    engine.blocks.check_all_free()
    return torch.tensor([s.output_ids for s in seqs])


def test_sd_with_a_mapped_draft_matches_the_target_distribution(models):
    target, _, mapped = models
    out = _sd_samples(target, BatchDrafter(mapped, DraftConfig(k=3, num_blocks=4096, block_size=8)))
    assert min_pvalue(out, exact_pairs(target, 4, VOCAB, PROMPT)) > 1e-3


def test_control_full_vocabulary_q_while_drafting_from_the_map_fails(models):
    target, full, _ = models
    out = _sd_samples(target, FullVocabQDrafter(full, DraftConfig(k=3, num_blocks=4096, block_size=8), MAP))
    assert min_pvalue(out, exact_pairs(target, 4, VOCAB, PROMPT)) < 1e-6
