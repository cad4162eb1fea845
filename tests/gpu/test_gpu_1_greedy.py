"""fp32 greedy on the GPU: AR, SD and SSD equal the target's own transformers ``generate()`` (greedy, fp32, same
device) token for token, on 2 code + 2 chat prompts x 32 new tokens; and the batched engine (6 concurrent
requests) gives in SD mode exactly what it gives in AR mode."""

from __future__ import annotations

import time

import pytest
import torch

from spec_core.config import SamplingParams, SSDConfig

pytestmark = pytest.mark.gpu

NEW = 32
K_SD, K_SSD = 4, 2


def test_transformers_reference_is_on_the_device(hf_target, hf_greedy, prompts, device, log):
    assert hf_target.device.type == torch.device(device).type, hf_target.device
    ref = hf_greedy(prompts[0], NEW)
    log(f"transformers greedy, prompt 0: {len(ref)} tokens")
    assert 0 < len(ref) <= NEW


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_generator_greedy_equals_transformers(mode, generator_cls, fp32_pair, prompts, hf_greedy, compare, log):
    """``Generator`` (``ssd generate``'s path) over the pair loaded with ``ModelConfig(..., device=cuda:0)``."""
    gen = generator_cls.from_pair(fp32_pair, k=K_SD)
    bad = []
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        res = gen.generate(ids, SamplingParams(max_new_tokens=NEW), mode=mode, request_id=f"{mode}{i}")
        log(f"{mode} prompt {i}: {len(res.token_ids)} tokens in {time.perf_counter() - t0:.2f}s")
        if (msg := compare(f"{mode} prompt {i}", res.token_ids, hf_greedy(ids, NEW), ids)) is not None:
            bad.append(msg)
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(300)
def test_ssd_greedy_equals_transformers(fp32_pair, real_pair, prompts, hf_greedy, compare, cores, log):
    """Local two-process SSD: the verifier engine on the device here, the drafter in its own process."""
    from cluster.local_ssd import LocalPlacement, LocalSSD, generate_ssd
    from spec_core.settings import ServiceConfig

    cfg = ServiceConfig(draft=real_pair["draft"], k=K_SSD, fixed_k=True, max_num_seqs=4)
    place = LocalPlacement(verifier_core=cores[0], drafter_core=cores[1])
    bad = []
    with LocalSSD(fp32_pair.target, cfg, place, eos_ids=fp32_pair.eos_ids) as local:
        log(f"drafter process ready: {local.drafter_info} (device: "
            f"{local.drafter_info.get('device', 'not reported')})")
        for i, ids in enumerate(prompts):
            seq, stats, ssd = generate_ssd(local, ids, SamplingParams(max_new_tokens=NEW), request_id=f"ssd{i}")
            log(f"ssd prompt {i}: {len(seq.output_ids)} tokens, cache hit rate {ssd.get('cache_hit_rate')}, "
                f"backup rounds {ssd.get('backup_rounds')}")
            if (msg := compare(f"ssd prompt {i}", seq.output_ids, hf_greedy(ids, NEW), ids)) is not None:
                bad.append(msg)
        assert local.restarts == 0, f"the drafter process died {local.restarts} time(s) during the run"
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(180)
def test_ssd_drafter_process_gets_the_device(real_pair, fp32_pair, device, cores, log):
    """On a GPU the SSD drafter process should run its draft model on the GPU too, not on one CPU core."""
    from cluster.local_ssd import LocalPlacement, LocalSSD
    from drafter_service.process import DrafterProcessConfig, spawn_drafter
    from protos import codec
    from spec_core.settings import ServiceConfig

    hello = codec.make_hello("", fp32_pair.target.vocab_size, K_SSD, SSDConfig().fanout.budget, "")
    proc, link, info = spawn_drafter(DrafterProcessConfig(real_pair["draft"], SSDConfig(k=K_SSD), core=None,
                                                          device=device), hello)
    try:
        log(f"drafter process with device={device}: ready message {info}")
        assert str(info.get("device", "not reported")).startswith(torch.device(device).type), \
            f"the drafter's ready message should report its device ({device}); got {info}"
    finally:
        link.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    cfg = ServiceConfig(draft=real_pair["draft"], k=K_SSD, fixed_k=True)
    place = LocalPlacement(verifier_core=cores[0], drafter_core=cores[1])
    with LocalSSD(fp32_pair.target, cfg, place, eos_ids=fp32_pair.eos_ids) as local:
        got = str(local.drafter_info.get("device", "not reported"))
    assert got.startswith(torch.device(device).type), \
        f"LocalSSD with the target on {fp32_pair.target.device} should start its drafter there too; got {got}"


@pytest.mark.timeout(300)
def test_batched_sd_equals_ar_with_concurrent_requests(fp32_pair, prompt_sets, hf_greedy, compare, log):
    """``ssd batch``'s engine (cluster.offline_batch → VerifierEngine): 6 requests at once, SD == AR, and AR ==
    transformers."""
    from cluster.offline_batch import batch_engine, make_sequences
    from verifier_service.batch_requests import BatchSettings

    prompts = prompt_sets["code"] + prompt_sets["chat"]
    outs = {}
    for mode in ("ar", "sd"):
        engine = batch_engine(fp32_pair, BatchSettings(mode=mode, concurrency=len(prompts), k=K_SD))
        seqs = make_sequences(fp32_pair, [(f"{mode}{i}", ids, SamplingParams(max_new_tokens=NEW))
                                          for i, ids in enumerate(prompts)])
        for seq in seqs:
            engine.add(seq)
        t0 = time.perf_counter()
        engine.run()
        sizes = engine.metrics.batch_sizes
        log(f"batch {mode}: {sum(len(s.output_ids) for s in seqs)} tokens in {time.perf_counter() - t0:.2f}s, "
            f"{engine.metrics.num_steps} steps, batch size max {max(sizes)} mean {sum(sizes) / len(sizes):.1f}")
        assert max(sizes) >= 4, f"{mode}: the engine never ran 4 requests in one step (batch sizes {sizes[:20]})"
        engine.blocks.check_all_free()
        outs[mode] = [list(s.output_ids) for s in seqs]
    bad = [m for i, (a, b) in enumerate(zip(outs["sd"], outs["ar"]))
           if (m := compare(f"batched sd vs batched ar, prompt {i}", a, b, prompts[i])) is not None]
    bad += [m for i, (a, ids) in enumerate(zip(outs["ar"], prompts))
            if (m := compare(f"batched ar vs transformers, prompt {i}", a, hf_greedy(ids, NEW), ids)) is not None]
    assert not bad, "\n".join(bad)
