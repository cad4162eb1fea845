"""Coupled sampling makes a sampled request's tokens a function of its seed alone: SSD (pre-drafted hits, just-in-time
drafts, the n-gram backup), SD and plain decoding give the same tokens, four requests at a time, with a draft that
differs from the target; the CLI gives the same tokens in every mode; and ``auto`` couples seeded requests only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import DrafterDown
from fault_injection import ForgetfulDrafter

from drafter_service.loopback import LoopbackLink
from drafter_service.ssd_drafter import SSDDrafter
from spec_core.config import SamplingParams, SSDConfig, TreeShape
from spec_core.draft_engine import BatchDrafter, DraftConfig
from spec_core.fanout import FanoutConfig
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from verifier_service.engine import EngineConfig, VerifierEngine
from verifier_service.scheduler import SchedulerConfig
from verifier_service.ssd_proposer import SSDProposer

K = 3
NEW = 24


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(8)
    base = torch.randint(0, 256, (6,), generator=gen).tolist()
    return [base * 2, base[::-1] * 2 + [7], torch.randint(0, 256, (9,), generator=gen).tolist(), base + base[:3]]


def _run(target: ModelRunner, drafter=None, k: int = K, sampling: str = "coupled", seeded: bool = True):
    sched = SchedulerConfig(max_num_seqs=4, max_spec_nodes=12)  # every tree here fits
    engine = VerifierEngine(target, EngineConfig(2048, 16, sched, sampling=sampling), drafter=drafter,
                            k=k if drafter is not None else 0)
    seqs = [Sequence(str(i), p, SamplingParams(temperature=0.8, seed=50 + i if seeded else None,
                                               max_new_tokens=NEW, ignore_eos=True))
            for i, p in enumerate(_prompts())]
    for s in seqs:
        engine.add(s)
    engine.run()
    engine.blocks.check_all_free()
    return [s.output_ids for s in seqs], seqs


def _ssd(draft: ModelRunner, link: str = "loopback", forgetful: bool = False) -> SSDProposer:
    cfg = SSDConfig(k=K, fanout=FanoutConfig(budget=6), tree=TreeShape.uniform(2, 2))
    if link == "down":
        return SSDProposer(DrafterDown(), 256, wait_fraction=0.0, backup_policy="neural", max_nodes=cfg.max_nodes)
    drafter = (ForgetfulDrafter if forgetful else SSDDrafter)(draft, cfg)
    return SSDProposer(LoopbackLink(drafter), 256, wait_fraction=0.5, backup_policy="neural",
                       max_nodes=cfg.max_nodes)


def test_coupled_tokens_are_the_same_in_every_mode_and_regime(tiny_models):
    target = ModelRunner(tiny_models["llama"])
    draft = ModelRunner(tiny_models["llama-noisy"])
    plain, seqs = _run(target)
    assert all(s.params.coupled for s in seqs)
    hits = _ssd(draft)
    jit = _ssd(draft, forgetful=True)
    backup = _ssd(draft, link="down")
    for proposer in (hits, jit, backup):
        assert _run(target, proposer)[0] == plain
    assert hits.stats.hits > 0 and hits.stats.off_spine_rounds > 0, hits.stats
    assert jit.stats.hits == 0 and jit.stats.jit_misses == jit.stats.rounds > 0, jit.stats
    assert backup.stats.backup_misses == backup.stats.rounds and backup.stats.backup > 0, backup.stats
    sd = BatchDrafter(draft, DraftConfig(k=K, branching=2, num_blocks=2048, block_size=16))
    out, sd_seqs = _run(target, sd)
    assert out == plain
    accepted = sum(s.stats.num_accepted for s in sd_seqs)
    assert 0 < accepted < sum(s.stats.num_drafted for s in sd_seqs)  # the draft differs: some rejections


def test_auto_couples_seeded_requests_only(tiny_models):
    target = ModelRunner(tiny_models["llama"])
    _, seeded = _run(target, sampling="auto")
    _, unseeded = _run(target, sampling="auto", seeded=False)
    _, residual = _run(target, sampling="residual")
    assert all(s.params.coupled for s in seeded) and not any(s.params.coupled for s in unseeded)
    assert not any(s.params.coupled for s in residual) and all(s.reproducible for s in residual)
    with pytest.raises(ValueError, match="sampling must be one of"):
        EngineConfig(sampling="gumbel")


def _cli_generate(mode: str) -> list[int]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run([sys.executable, "-m", "ssd_cli", "generate", "--mode", mode, "--prompt", "def add(a, b):",
                          "--temperature", "0.8", "--seed", "7", "--max-new-tokens", "12", "--ignore-eos", "--k", "3",
                          "--sampling", "coupled", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)["token_ids"]


@pytest.mark.usefixtures("real_pair")
def test_cli_coupled_sampling_gives_the_same_tokens_in_ar_and_ssd():
    """Through the real interface: ``ssd generate`` on the default pair, the drafter in its own process."""
    assert _cli_generate("ssd") == _cli_generate("ar")
