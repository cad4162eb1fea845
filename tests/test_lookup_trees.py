"""Prompt lookup in SSD: a lookup branch in each outcome's tree (merged with the spine, hung where they part, up to
2K deep), lookup's guess at every outcome's bonus, their measures, the wire, and greedy output equal to AR."""

from __future__ import annotations

import random

import pytest
import torch
from reference_decoding import greedy_outputs
from test_ssd_trees import _loopback_run

from drafter_service.candidate_trees import (
    LOOKUP_EXPLORE_EVERY,
    GrowingTree,
    LookupStats,
    bonus_candidates,
    lookup_for_steps,
    step_time,
)
from protos import codec
from spec_core.config import SSD_DEFAULT_TREE, SSDConfig, TreeShape, lookup_depth
from spec_core.estimators import STEP_TABLE_TOKENS, LinearCost, StepTimes
from spec_core.fanout import FanoutConfig, tree_fanout
from spec_core.ngram import NgramIndex, propose_ngram
from spec_core.runner import ModelRunner
from spec_core.speculation import Speculation


def test_ngram_index_proposes_what_a_rescan_proposes():
    """Synced incrementally (or from scratch after a rewrite), the index answers every query as ``propose_ngram``
    over the whole context does, including matches that overlap the extension."""
    rng = random.Random(3)
    for _ in range(2000):
        vocab = rng.choice([3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(40))]
        index = NgramIndex()
        index.sync(tokens[: rng.randrange(len(tokens) + 1)])
        index.sync(tokens)
        ext = [rng.randrange(vocab) for _ in range(rng.randrange(5))]
        k, min_n = rng.randrange(7), rng.randrange(1, 4)
        assert index.propose(ext, k, min_n) == propose_ngram(tokens + ext, k, min_n=min_n), (tokens, ext, k, min_n)
    index = NgramIndex()
    index.sync([1, 2, 3, 1, 2])
    index.sync([9, 2, 3, 9, 2])  # not an extension: indexed from scratch
    assert index.propose([], 2) == [3, 9] == propose_ngram([9, 2, 3, 9, 2], 2)


def _tree(spine, leaves) -> GrowingTree:
    tree = GrowingTree()
    for tok, side in zip(spine, leaves):
        tree.add(tok, None, side, None)
    return tree


def test_lookup_branch_merges_with_the_spine_and_hangs_where_they_part():
    tree = _tree([10, 11, 12], [[20], [30, 31], []])
    plain = tree.speculation()
    assert plain.lookup_from is None and plain.token_ids == [10, 11, 12, 20, 30, 31]
    spec = tree.speculation("cache", [10, 30, 40, 41, 42], 8)  # agrees on 10, parts at depth 2 (30: a leaf there)
    assert spec.token_ids == [10, 11, 12, 20, 31, 30, 40, 41, 42]  # the leaf 30 makes way for the branch's node
    assert spec.parents == [-1, 0, 1, -1, 0, 0, 5, 6, 7] and spec.lookup_from == 5
    assert spec.k == 3 and max(Speculation(spec.token_ids, parents=spec.parents).truncated(9).token_ids) == 42
    assert tree.speculation("cache", [10, 30, 40], 1).token_ids[5:] == [30]  # at most max_lookup nodes
    assert tree.speculation("cache", [10, 11, 12, 13], 8).lookup_from is None  # all on the spine: nothing new
    assert tree.speculation("cache", [], 8) == plain
    sampled = GrowingTree()
    sampled.add(10, torch.ones(4) / 4, [], None)
    with pytest.raises(ValueError, match="greedy"):
        sampled.speculation("cache", [7], 2)


def test_truncation_keeps_the_lookup_branch_to_twice_the_lookahead():
    spec = _tree([10, 11, 12], [[20], [], []]).speculation("cache", [30, 31, 32, 33, 34, 35, 36], 8)
    assert spec.lookup_from == 4 and len(spec.token_ids) == 4 + 6  # 2K = 6 deep: the 7th token is not drafted
    assert spec.truncated(3) == spec
    two = spec.truncated(2)  # spine and leaves to depth 2, the lookup branch to depth 4
    assert two.token_ids == [10, 11, 20, 30, 31, 32, 33] and two.lookup_from == 3
    assert two.parents == [-1, 0, -1, -1, 3, 4, 5]
    assert spec.truncated(3, max_nodes=4).lookup_from is None  # the budget cuts the branch first
    assert lookup_depth(3) == 6 and lookup_depth(12) == 16


def test_the_lookup_branch_round_trips_on_the_wire():
    spec = _tree([10, 11], [[20], []]).speculation("cache", [30, 31, 32], 8)
    back = codec.speculation_from_pb(codec.speculation_to_pb(spec), 64)
    assert (back.token_ids, back.parents, back.lookup_from) == (spec.token_ids, spec.parents, 3)
    assert codec.speculation_from_pb(codec.speculation_to_pb(Speculation([1, 2])), 64).lookup_from is None
    bad = codec.speculation_to_pb(spec)
    bad.lookup_from = 9
    with pytest.raises(ValueError, match="lookup_from"):
        codec.speculation_from_pb(bad, 64)


def test_tree_shapes_name_their_lookup_branch():
    auto = TreeShape.parse("auto")
    assert auto.lookup and auto == SSD_DEFAULT_TREE and str(auto) == "auto"
    off = TreeShape.parse("auto+nolookup")
    assert not off.lookup and off.auto and str(off) == "auto+nolookup" and TreeShape.parse(str(off)) == off
    fixed = TreeShape.parse("2x2+lookup")
    assert fixed.lookup and str(fixed) == "2x2+lookup" and not TreeShape.parse("chain+lookup").is_chain
    assert not TreeShape.parse("chain").lookup and not TreeShape.parse("2x2").lookup
    assert fixed.max_nodes(3) == 3 + 2 + 6 and SSDConfig(k=3, tree=fixed).max_nodes == 11


def test_lookup_guesses_each_bonus_first():
    ranked = [[5, 6, 7], [5, 8, 9], [1, 2, 3]]
    out = bonus_candidates(ranked, [-1, 0], [5, 9], [7, 9, None])
    assert out[0] == [7, 6]  # the guess first; the root's child 5 is never a bonus there
    assert out[1] == [5, 8]  # a guess equal to the slot's own child (9) is dropped, as is the child
    assert out[2] == [1, 2, 3]


def test_lookup_nodes_are_kept_while_they_pay_and_probed_when_they_do_not():
    stats = LookupStats()
    assert stats.keep(6, None) == 6  # no measured price: all
    for _ in range(40):
        stats.observe(0, 3, [0, 1])  # nodes 0 and 1 accepted, the round ended on 1; node 2 rejected
    assert stats.accept[0].value > 0.9 and stats.accept[2].value < 0.1 and stats.end[1].value > 0.9
    assert stats.keep(6, 0.5) == 2
    for _ in range(60):
        stats.observe(0, 3, [])
    kept = [stats.keep(6, 0.5) for _ in range(2 * LOOKUP_EXPLORE_EVERY)]
    assert kept.count(6) == 2 and kept.count(0) == 2 * LOOKUP_EXPLORE_EVERY - 2


#: A staircase like bf16's here (ms by tokens 1..12): flat to 6, +13% at 7, then about 1.3 ms a token.
STAIR = [t / 1e3 for t in (27.0, 27.1, 27.5, 26.3, 26.9, 27.6, 31.3, 32.4, 33.4, 35.1, 36.5, 37.7)]


def test_lookup_is_sized_by_the_verifiers_stair():
    """A spine of 3 with a root (4 tokens) and 2.3 expected tokens: the branch's first two nodes are free; past
    6 tokens a node pays only if it and those behind it add more than the stair costs. (A line's slope, about
    1 ms a node here, would keep the first five of DECAY.)"""
    decay = [0.5, 0.35, 0.25, 0.15, 0.1, 0.05]
    assert lookup_for_steps(decay, 2.3, 4, STAIR) == 2  # fits below the stair, no further
    assert lookup_for_steps([0.9] * 6, 2.3, 4, STAIR) == 6  # a repetitive prompt: all of it pays
    assert lookup_for_steps([0.0] * 6, 2.3, 4, STAIR) == 0
    assert lookup_for_steps([0.3, 0.9, 0.9], 2.3, 4, STAIR) == 2  # held non-increasing: nodes 1, 2 count 0.3
    assert lookup_for_steps(decay, 2.3, 9, STAIR) == 4  # a step already past the stair: only the slope is left
    assert step_time(STAIR, 14) == pytest.approx(STAIR[-1] + 2 * (STAIR[-1] - STAIR[-2]))
    stats = LookupStats()
    assert stats.budget(6, 0.6, 3, 4, STAIR, None) == 6  # the prior, 0.3 a node at every depth, pays throughout
    assert stats.budget(6, 0.6, 3, 4, None, None) == 6  # nothing measured: all
    assert stats.budget(6, 0.6, 3, 4, None, 0.5) == 0  # a per-node price above the prior's 0.3


def test_step_times_fill_unseen_sizes_from_the_line():
    fit, steps = LinearCost(), StepTimes()
    assert steps.table(fit) is None
    for n, t in ((3, 0.027), (7, 0.031), (3, 0.027), (7, 0.031)):
        fit.observe(n, t)
        steps.observe(n, t)
    table = steps.table(fit)
    assert len(table) == STEP_TABLE_TOKENS and table[2:7:4] == pytest.approx([0.027, 0.031])
    assert table[4] == pytest.approx(0.029)  # 5 tokens: never seen, from the line
    steps.observe(STEP_TABLE_TOKENS + 1, 1.0)  # past the table: not kept
    assert STEP_TABLE_TOKENS + 1 not in steps.seconds


def test_verify_costs_table_follows_the_last_verify():
    """The verifier's step table for the drafter: none before the line exists, then as of the latest verify
    (made on demand), with the node cost the slope's share of the last step."""
    from spec_core.estimators import VerifyCosts

    costs = VerifyCosts()
    costs.observe(3, 0.027)
    assert costs.table() is None and costs.node_cost() is None  # one step size: no line yet
    for n, t in ((7, 0.031), (3, 0.027), (7, 0.031)):
        costs.observe(n, t)
    assert costs.table()[2:7:4] == pytest.approx([0.027, 0.031])
    assert costs.node_cost() == pytest.approx(0.001 / 0.031)
    costs.observe(7, 0.041)  # a slower step of 7: the next table has it
    assert costs.table()[6] == pytest.approx(0.8 * 0.031 + 0.2 * 0.041)  # StepTimes' mean, alpha 0.2


def test_fan_out_covers_the_lookup_slots():
    cfg = FanoutConfig(budget=12)
    plain = tree_fanout(cfg, 3, [1, 0, 0], 0.6, 1.0, 0.3)
    fan = tree_fanout(cfg, 3, [1, 0, 0], 0.6, 1.0, 0.3, [0.5, 0.02])
    assert len(fan) == len(plain) + 2 and sum(fan) == 12 and fan[-2] > fan[-1]
    assert tree_fanout(cfg, 3, [0, 0, 0], 0.6, 1.0, 0.3, [0.3])[-1] > 0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target over 8 tokens, whose greedy text falls into repeats that prompt lookup can copy (a 256-token
    random target almost never repeats itself), and a noisy copy of it as the draft."""
    from conftest import NOISY_SCALE, save_noisy_copy, save_tiny_model

    base = tmp_path_factory.mktemp("lookup")
    target = save_tiny_model(base / "target", "llama", 7, vocab_size=8)
    return ModelRunner(target), ModelRunner(save_noisy_copy(target, base / "draft", NOISY_SCALE, 8))


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 8, (6 + 2 * i,), generator=gen).tolist() for i in range(n)]


@pytest.mark.parametrize("regime", ["hits", "jit", "backup"])
def test_greedy_lookup_trees_equal_ar_in_every_regime(pair, regime):
    """Four concurrent requests, the default tree (``auto``: leaves and the lookup branch) and lookup's bonus
    guesses: output equals AR token for token, whichever regime served the rounds."""
    target, draft = pair
    prompts = _prompts(4)
    outs, s, _ = _loopback_run(target, draft, SSD_DEFAULT_TREE, prompts, 24, forgetful=regime != "hits",
                               jit=regime != "backup")
    assert outs == greedy_outputs(target, prompts, 24)
    if regime != "backup":
        assert s.lookup_nodes > 0 and s.lookup_tokens > 0, s  # lookup nodes were verified and accepted
    if regime == "hits":
        assert s.hits > 0, s
    elif regime == "backup":
        assert s.backup_misses == s.rounds and s.lookup_nodes == 0, s
