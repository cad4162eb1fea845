"""Sampling on the GPU: top-k / top-p / temperature through AR and SD (single-request and batched) run and are
reproducible for a fixed seed; SSD at temperature 0.8 runs and completes."""

from __future__ import annotations

import pytest

from spec_core.config import SamplingParams

pytestmark = pytest.mark.gpu

NEW = 24


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=seed, max_new_tokens=NEW, ignore_eos=True)


def _run(path: str, pair, generator_cls, prompts, seed: int) -> list[list[int]]:
    if path.startswith("generator-"):
        mode = path.removeprefix("generator-")
        gen = generator_cls.from_pair(pair, k=4)
        return [gen.generate(ids, _params(seed), mode=mode, request_id=f"s{i}").token_ids
                for i, ids in enumerate(prompts)]
    from cluster.offline_batch import batch_engine, make_sequences
    from verifier_service.batch_requests import BatchSettings

    engine = batch_engine(pair, BatchSettings(mode=path.removeprefix("batch-"), concurrency=len(prompts), k=4))
    seqs = make_sequences(pair, [(f"s{i}", ids, _params(seed)) for i, ids in enumerate(prompts)])
    for seq in seqs:
        engine.add(seq)
    engine.run()
    return [list(s.output_ids) for s in seqs]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["generator-ar", "generator-sd", "batch-ar", "batch-sd"])
def test_top_k_sampling_runs_and_is_reproducible(path, fp32_pair, generator_cls, prompts, log):
    """temperature 0.8, top_k 20, top_p 0.95, seed 1234 twice: the same tokens; every id in the vocabulary."""
    ps = prompts[::2]  # one code, one chat prompt
    first = _run(path, fp32_pair, generator_cls, ps, seed=1234)
    again = _run(path, fp32_pair, generator_cls, ps, seed=1234)
    other = _run(path, fp32_pair, generator_cls, ps, seed=4321)
    vocab = fp32_pair.target.vocab_size
    for i, out in enumerate(first):
        assert len(out) == NEW, f"{path} prompt {i}: {len(out)} tokens, expected {NEW} (ignore_eos)"
        assert all(0 <= t < vocab for t in out), f"{path} prompt {i}: ids out of the vocabulary: {out}"
    assert first == again, f"{path}: seed 1234 twice gave different tokens:\n{first}\n{again}"
    log(f"{path}: reproducible; seed 4321 differs from seed 1234 on "
        f"{sum(a != b for a, b in zip(first, other))}/{len(ps)} prompts")


@pytest.mark.timeout(300)
def test_ssd_sampled_completes(fp32_pair, real_pair, prompts, cores, log):
    """SSD at temperature 0.8 (the drafter ships its proposal rows; exact stochastic verification on the device)."""
    from cluster.local_ssd import LocalPlacement, LocalSSD, generate_ssd
    from spec_core.settings import ServiceConfig

    cfg = ServiceConfig(draft=real_pair["draft"], k=2, fixed_k=True, max_num_seqs=4)
    place = LocalPlacement(verifier_core=cores[0], drafter_core=cores[1])
    vocab = fp32_pair.target.vocab_size
    with LocalSSD(fp32_pair.target, cfg, place, eos_ids=fp32_pair.eos_ids) as local:
        for i, ids in enumerate(prompts[::2]):
            params = SamplingParams(temperature=0.8, seed=7 + i, max_new_tokens=NEW, ignore_eos=True)
            seq, stats, ssd = generate_ssd(local, ids, params, request_id=f"t{i}")
            log(f"ssd t=0.8 prompt {i}: {len(seq.output_ids)} tokens, finish {seq.finish_reason}, "
                f"cache hit rate {ssd.get('cache_hit_rate')}, backup rounds {ssd.get('backup_rounds')}")
            assert len(seq.output_ids) == NEW and seq.finish_reason == "length", \
                (len(seq.output_ids), seq.finish_reason)
            assert all(0 <= t < vocab for t in seq.output_ids), seq.output_ids
        assert local.restarts == 0, f"the drafter process died {local.restarts} time(s) during the run"


def test_coupled_picks_are_the_same_on_the_device_and_the_host(device, log):
    """Coupled sampling's race (spec_core.coupling) runs in torch on a device and in numpy on the host: the same
    integers, so the same picks but for a near-tie that a last-bit difference in ``log`` could flip."""
    import torch

    from spec_core.coupling import coupled_picks, coupling_keys

    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(256, 49152, generator=gen) * 3, -1)
    keys = torch.tensor(coupling_keys(5, range(256)))
    host = coupled_picks(probs, keys)
    on_device = coupled_picks(probs.to(device), keys.to(device))
    same = sum(a == b for a, b in zip(host, on_device))
    log(f"coupled picks, device vs host: {same}/256 the same")
    assert same >= 254
