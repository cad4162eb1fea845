"""At temperature 0.8 the SSD loop's output follows the target's distribution (chi-square on every adjacent pair of
tokens), with a draft that differs from the target, candidate trees, Saguaro C = 1 and C = 0.3, and each regime
forced on its own: pre-drafted hits, misses drafted just in time, misses served by the n-gram backup. The negative
controls run inside the same loop at the same sample size and must fail: raw q shipped for a q′ sample, greedy-match
acceptance of backup tokens, and tree verification without sibling recursion."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import DrafterDown, save_noisy_copy, save_tiny_model
from fault_injection import (
    ForgetfulDrafter,
    GreedyMatchBackupProposer,
    RawQDrafter,
    coupling_without_position,
    without_sibling_recursion,
)
from scipy.stats import chisquare

from drafter_service.loopback import LoopbackLink
from drafter_service.ssd_drafter import SSDDrafter
from spec_core.config import SamplingParams, SSDConfig, TreeShape
from spec_core.fanout import FanoutConfig
from spec_core.runner import ModelRunner
from spec_core.sampling import logits_to_probs
from spec_core.sequence import Sequence
from verifier_service.engine import EngineConfig, VerifierEngine
from verifier_service.scheduler import SchedulerConfig
from verifier_service.ssd_proposer import SSDProposer

logger = logging.getLogger(__name__)

VOCAB = 8
N = 1500
M = 6  # tokens per sequence: several speculating rounds each, so the forced regime's rounds dominate
TEMP = 0.8
K = 2
TREE = TreeShape.uniform(2, 2)  # a sampled leaf beside every spine node: siblings, so sibling recursion matters
PROMPT = [3, 1, 4, 1, 3, 1, 4]  # repetitive: the n-gram backup finds proposals


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("dist")
    target = save_tiny_model(base / "t", "llama", 31, vocab_size=VOCAB)
    # A draft unlike the target, but close enough that its pre-drafted branches hit often.
    return ModelRunner(target), ModelRunner(save_noisy_copy(target, base / "d", 0.15, 8))


@pytest.fixture(scope="module")
def tables(pair) -> list[torch.Tensor]:
    return exact_pairs(pair[0])


def exact_pairs(target: ModelRunner, m: int = M, vocab: int = VOCAB, prompt: list[int] = PROMPT,
                temp: float = TEMP) -> list[torch.Tensor]:
    """Marginal tables P(t_i, t_{i+1}) [V, V] of the target at ``temp`` after ``prompt``, for i = 0..m-2."""
    v = vocab
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = torch.zeros(1, 0, dtype=torch.long)
    for _ in range(m):
        ctx = torch.cat([torch.tensor(prompt).expand(prefixes.shape[0], -1), prefixes], dim=1)
        n, t = ctx.shape
        logits = target.forward(target.new_cache(n, t + 1), ctx, torch.arange(t).expand(n, -1),
                                logits_index=torch.full((n, 1), t - 1))
        probs = logits_to_probs(logits, torch.full((n,), temp))[:, 0].double()  # [n, V]
        joint = (joint[:, None] * probs).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(v, 0), torch.arange(v).repeat(n)[:, None]], dim=1)
    full = joint.view(*([v] * m))
    return [full.sum(dim=tuple(d for d in range(m) if d not in (i, i + 1))) for i in range(m - 1)]


def run_ssd(target, draft, c: float, regime: str, drafter_class=SSDDrafter, proposer_class=SSDProposer,
            sampling: str = "residual"):
    """``regime``: hits (the drafter's cache), jit (it drops its cache: every round drafted just in time) or
    backup (no drafter: every round an n-gram proposal). ``sampling``: the engine's rule (the requests are seeded,
    which ``auto`` would couple); coupled requests draft the greedy tree, so it is ``TREE`` too. The classes:
    the real drafter and proposer, or a negative control's (:mod:`fault_injection`)."""
    cfg = SSDConfig(k=K, fanout=FanoutConfig(budget=8), saguaro_c=c, num_blocks=8192, block_size=8,
                    sampled_tree=TREE, tree=TREE)
    if regime == "jit":
        drafter_class = ForgetfulDrafter
    link = DrafterDown() if regime == "backup" else LoopbackLink(drafter_class(draft, cfg))
    proposer = proposer_class(link, VOCAB, wait_fraction=0.5, backup_policy="neural")
    engine = VerifierEngine(target, EngineConfig(8192, 8, SchedulerConfig(max_num_seqs=512,
                                                                           max_spec_nodes=cfg.max_nodes),
                                                 sampling=sampling),
                            drafter=proposer, k=K)
    return sample_requests(engine), proposer.stats


def sample_requests(engine: VerifierEngine) -> torch.Tensor:
    """``N`` seeded requests of ``M`` tokens at ``TEMP`` after ``PROMPT`` through ``engine``: their tokens
    ``[N, M]``; every K/V block is free afterwards."""
    seqs = [Sequence(str(i), PROMPT, SamplingParams(temperature=TEMP, seed=i, max_new_tokens=M, ignore_eos=True))
            for i in range(N)]
    for s in seqs:
        engine.add(s)
    engine.run()
    engine.blocks.check_all_free()
    return torch.tensor([s.output_ids for s in seqs])


def pvalue(a: torch.Tensor, b: torch.Tensor, table: torch.Tensor) -> float:
    v = table.shape[0]
    counts = torch.bincount(a * v + b, minlength=v * v).double()
    expected = table.reshape(-1).double() * a.numel()
    big = expected >= 5
    obs, exp = counts[big].tolist() + [counts[~big].sum().item()], expected[big].tolist() + [expected[~big].sum().item()]
    obs, exp = zip(*[(o, e) for o, e in zip(obs, exp) if e > 0])
    scale = sum(obs) / sum(exp)
    return float(chisquare(list(obs), [e * scale for e in exp]).pvalue)


def min_pvalue(out: torch.Tensor, tables: list[torch.Tensor]) -> float:
    """The smallest p-value over the adjacent-pair marginals (each must pass; the controls fail some)."""
    return min(pvalue(out[:, i], out[:, i + 1], t) for i, t in enumerate(tables))


def _report(label: str, stats, p: float) -> None:
    line = (f"{label}: rounds {stats.rounds}, hits {stats.hits}, jit {stats.jit_misses}, backup {stats.backup_misses},"
            f" off-spine {stats.off_spine_rounds}, tree nodes/round {stats.mean_tree_nodes or 0:.2f}, min p {p:.3g}")
    logger.info(line)
    print(line)


def _check_regime(stats, regime: str) -> None:
    """The forced regime serves (nearly) every round, and trees are really verified where they can be."""
    if regime == "hits":
        assert stats.hits >= 0.6 * stats.rounds and stats.off_spine_rounds > 0, stats
    elif regime == "jit":
        assert stats.hits == 0 and stats.jit_misses == stats.rounds and stats.off_spine_rounds > 0, stats
    else:
        assert stats.hits == 0 and stats.backup_misses == stats.rounds and stats.backup > 0.5 * stats.rounds, stats


@pytest.mark.parametrize(("c", "regime"), [(1.0, "hits"), (0.3, "hits"), (1.0, "jit"), (0.3, "jit"),
                                           (1.0, "backup")])
def test_ssd_matches_target_distribution(pair, tables, c, regime):
    """C only shapes the drafter's q′, so the backup regime (n-gram proposals) runs once."""
    out, stats = run_ssd(*pair, c, regime)
    p = min_pvalue(out, tables)
    _report(f"C={c} {regime}", stats, p)
    _check_regime(stats, regime)
    assert p > 1e-3


def test_control_raw_q_for_saguaro_sample_fails(pair, tables):
    out, stats = run_ssd(*pair, 0.3, "hits", drafter_class=RawQDrafter)
    p = min_pvalue(out, tables)
    _report("control raw q", stats, p)
    assert p < 1e-6


def test_control_greedy_match_backup_fails(pair, tables):
    out, stats = run_ssd(*pair, 1.0, "backup", proposer_class=GreedyMatchBackupProposer)
    p = min_pvalue(out, tables)
    _report("control greedy-match backup", stats, p)
    _check_regime(stats, "backup")
    assert p < 1e-6


def test_control_tree_without_sibling_recursion_fails(pair, tables, monkeypatch):
    without_sibling_recursion(monkeypatch)
    out, stats = run_ssd(*pair, 0.3, "hits")
    p = min_pvalue(out, tables)
    _report("control no sibling recursion", stats, p)
    _check_regime(stats, "hits")
    assert p < 1e-6


@pytest.mark.parametrize("regime", ["hits", "jit", "backup"])
def test_coupled_ssd_matches_target_distribution(pair, tables, regime, monkeypatch):
    """Coupled sampling (spec_core.coupling) through the same loop: each tree verified by argmax match against the
    target's races at its nodes' positions, backup chains too. A 3-token head, so among 8 tokens the tail's racer
    wins often and its inverse-CDF pick is exercised."""
    from spec_core import coupling

    monkeypatch.setattr(coupling, "COUPLE_HEAD", 3)
    out, stats = run_ssd(*pair, 1.0, regime, sampling="coupled")
    p = min_pvalue(out, tables)
    _report(f"coupled {regime}", stats, p)
    _check_regime(stats, regime)
    assert p > 1e-3


def test_control_coupled_races_not_keyed_by_position_fail(pair, tables, monkeypatch):
    """One race noise for all of a request's positions: its tokens are correlated."""
    coupling_without_position(monkeypatch)
    out, stats = run_ssd(*pair, 1.0, "hits", sampling="coupled")
    p = min_pvalue(out, tables)
    _report("control coupled without position", stats, p)
    assert p < 1e-6
