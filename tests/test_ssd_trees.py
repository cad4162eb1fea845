"""SSD with candidate trees: a tree per predicted outcome (spine + leaves), keyed by outcome slot, on the wire, and
verified as a tree. Greedy output equals AR whichever regime served the round."""

from __future__ import annotations

import pytest
import torch
from fault_injection import ForgetfulDrafter
from reference_decoding import greedy_outputs

from protos import codec
from spec_core.config import SamplingParams, SSDConfig, TreeShape
from spec_core.fanout import FanoutConfig, fanout_for, tree_fanout
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from spec_core.speculation import BranchBundle, OutcomeEvent, Speculation, path_nodes, spine_tree


# ---- the tree's shape and its outcome slots -----------------------------------------------------------------
def test_spine_tree_puts_the_spine_first_and_leaves_beside_it():
    tokens, parents = spine_tree([10, 11, 12], [[20], [21, 22], []])
    assert tokens == [10, 11, 12, 20, 21, 22]
    assert parents == [-1, 0, 1, -1, 0, 0]
    assert spine_tree([10, 11], [[], []]) == ([10, 11], None)  # no leaves: a chain
    spec = Speculation(tokens, parents=parents)
    assert spec.k == 3 and spec.num_nodes == 6
    assert path_nodes(parents, 5) == [0, 4]  # slot 5 = node 4 (a leaf beside spine node 1)
    assert path_nodes(None, 2) == [0, 1]


def test_truncation_keeps_a_tree_and_respects_the_node_budget():
    tokens, parents = spine_tree([10, 11, 12], [[20], [21], [22]])
    spec = Speculation(tokens, torch.eye(6, 8), parents=parents)
    two = spec.truncated(2)
    assert two.token_ids == [10, 11, 20, 21] and two.parents == [-1, 0, -1, 0]
    assert torch.equal(two.draft_probs, torch.eye(6, 8)[[0, 1, 3, 4]])
    capped = spec.truncated(3, max_nodes=4)
    assert capped.token_ids == [10, 11, 12, 20] and capped.parents == [-1, 0, 1, -1]
    assert Speculation([1, 2, 3]).truncated(3, max_nodes=2).token_ids == [1, 2]
    with pytest.raises(ValueError):
        Speculation([1, 2], parents=[-1, 1])


def test_outcome_event_on_a_tree():
    tokens, parents = spine_tree([10, 11, 12], [[20], [21], []])
    leaf = OutcomeEvent("r", 3, tokens, 2, 7, 3, parents=parents, slot=5)  # spine node 0, then the leaf 21
    assert leaf.key == (5, 7) and leaf.accepted == [10, 21] and leaf.spine_accepted == 1
    spine = OutcomeEvent("r", 3, tokens, 2, 7, 3, parents=parents, slot=2)
    assert spine.accepted == [10, 11] and spine.spine_accepted == 2
    chain = OutcomeEvent("r", 3, [10, 11, 12], 2, 7, 3)
    assert chain.key == (2, 7) and chain.accepted == [10, 11] and chain.spine_accepted == 2


def test_tree_shape_parses_and_counts_leaves():
    assert TreeShape.parse("2x2").leaves(4) == [1, 1, 0, 0]
    assert TreeShape.parse("chain").is_chain and str(TreeShape.parse("chain")) == "chain"
    assert TreeShape.parse("4,2").leaves(3) == [3, 1, 0] and str(TreeShape.parse("4,2,1")) == "4,2"
    assert str(TreeShape.parse("3x1")) == "3x1" and TreeShape.parse("1x3").is_chain
    assert SSDConfig(k=4, tree=TreeShape.uniform(3, 1)).max_nodes == 6
    with pytest.raises(ValueError, match="WIDTHxLEVELS"):
        TreeShape.parse("9x1")
    with pytest.raises(ValueError, match="WIDTHxLEVELS"):
        TreeShape.parse("wide")


def test_tree_fanout_reduces_to_the_chain_schedule_and_spends_the_budget():
    cfg = FanoutConfig(budget=12)
    assert tree_fanout(cfg, 4, [0, 0, 0, 0], 0.6, 1.0, 0.3) == fanout_for(cfg, 4, 0.6, 1.0)
    fan = tree_fanout(cfg, 4, [1, 1, 0, 0], 0.6, 1.0, 0.3)
    assert len(fan) == 4 + 1 + 2 and sum(fan) == 12
    low = tree_fanout(cfg, 4, [1, 1, 0, 0], 0.6, 1.0, 0.05)
    high = tree_fanout(cfg, 4, [1, 1, 0, 0], 0.6, 1.0, 0.9)
    assert sum(high[5:]) > sum(low[5:])  # likelier leaves get more of the budget


# ---- the codec ----------------------------------------------------------------------------------------------
def test_a_bundle_of_trees_round_trips_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    tokens, parents = spine_tree([3, 4, 5], [[6], [7], []])
    dense = torch.softmax(torch.randn(5, vocab, generator=gen), -1)
    sparse = torch.zeros(5, vocab)
    sparse[:, :4] = torch.softmax(torch.randn(5, 4, generator=gen), -1)
    bundle = BranchBundle("req", 7, [1, 2, 9, 8], {
        (0, 11): Speculation(tokens, dense, parents=parents),
        (5, 12): Speculation(tokens, sparse, parents=parents),
        (2, 13): Speculation([3, 4, 5], None),
    }, ready_at=1.5, base_parents=[-1, 0, -1, 0])
    back = codec.message_from_pb(type(codec.message_to_pb(bundle)).FromString(
        codec.message_to_pb(bundle).SerializeToString()), vocab)
    assert (back.request_id, back.round, back.base_tokens, back.base_parents, back.ready_at) == \
        ("req", 7, [1, 2, 9, 8], [-1, 0, -1, 0], 1.5)
    assert list(back.entries) == list(bundle.entries)
    for key, spec in bundle.entries.items():
        got = back.entries[key]
        assert (got.token_ids, got.parents) == (spec.token_ids, spec.parents)
        if spec.draft_probs is None:
            assert got.draft_probs is None
        else:
            assert torch.equal(got.draft_probs, spec.draft_probs)  # float32 both ways: exact
    ev = OutcomeEvent("req", 7, tokens, 2, 9, 3, verify_s=0.05, parents=parents, slot=5)
    back_ev = codec.event_from_pb(codec.event_to_pb(ev))
    assert (back_ev.parents, back_ev.slot, back_ev.key, back_ev.accepted) == (parents, 5, (5, 9), [3, 7])
    chain = codec.event_from_pb(codec.event_to_pb(OutcomeEvent("req", 7, [3, 4], 1, 9, 3)))
    assert chain.parents is None and chain.key == (1, 9)


# ---- the loop, greedy ---------------------------------------------------------------------------------------
def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (5 + 2 * i,), generator=gen).tolist() for i in range(n)]


def _loopback_run(target, draft, tree: TreeShape, prompts, n_new: int, forgetful=False, jit=True):
    from drafter_service.loopback import LoopbackLink
    from drafter_service.ssd_drafter import SSDDrafter
    from verifier_service.engine import EngineConfig, VerifierEngine
    from verifier_service.scheduler import SchedulerConfig
    from verifier_service.ssd_proposer import SSDProposer

    cfg = SSDConfig(k=4, fanout=FanoutConfig(budget=8), tree=tree)
    drafter = (ForgetfulDrafter if forgetful else SSDDrafter)(draft, cfg)
    proposer = SSDProposer(LoopbackLink(drafter, jit=jit), target.vocab_size,
                           wait_fraction=0.5 if jit else 0.0, backup_policy="neural" if jit else "fast")
    engine = VerifierEngine(target, EngineConfig(2048, 16, SchedulerConfig(max_num_seqs=4,
                                                                           max_spec_nodes=cfg.max_nodes)),
                            drafter=proposer, k=4)
    seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=n_new, ignore_eos=True)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    engine.run()
    engine.blocks.check_all_free()
    return [s.output_ids for s in seqs], proposer.stats, engine.metrics.stats


@pytest.fixture(scope="module")
def pair(tiny_models):
    return ModelRunner(tiny_models["llama"]), ModelRunner(tiny_models["llama-noisy"])


@pytest.mark.parametrize("regime", ["hits", "jit", "backup"])
def test_greedy_trees_equal_ar_in_every_regime(pair, regime):
    """Four concurrent requests, a draft unlike the target (so leaves are accepted), a 3x2 tree per outcome."""
    target, draft = pair
    prompts = _prompts(4)
    outs, s, _ = _loopback_run(target, draft, TreeShape.uniform(3, 2), prompts, 24, forgetful=regime != "hits",
                               jit=regime != "backup")
    assert outs == greedy_outputs(target, prompts, 24)
    if regime != "backup":  # the backup is an n-gram chain
        assert s.tree_nodes > 4 * s.rounds, s  # the verifier saw trees, not 4-token chains
    if regime == "hits":
        assert s.hits > 0 and s.off_spine_rounds > 0, s
        assert s.hits_rejected + s.hits_all_accepted + s.hits_off_spine == s.hits
    elif regime == "jit":
        assert s.hits == 0 and s.jit_misses == s.rounds and s.off_spine_rounds > 0, s
    else:
        assert s.hits == 0 and s.backup_misses == s.rounds, s


def test_greedy_trees_through_static_step_backends_equal_ar(pair):
    """Both engines over the static-buffer step (what a GPU captures as graphs; eager on a CPU): trees, glue and
    verification run from bucket-shaped buffers, and the output is still the target's own greedy."""
    from spec_core.backends.static_step import Buckets
    from spec_core.backends.torch_runner import RunnerBackend

    target, draft = pair
    prompts = _prompts(4)
    backends = [RunnerBackend(m, static=True, buckets=Buckets(context_step=1)) for m in (target, draft)]
    outs, s, _ = _loopback_run(*backends, TreeShape.uniform(3, 2), prompts, 24)
    assert outs == greedy_outputs(target, prompts, 24)
    assert s.hits > 0 and s.tree_nodes > 4 * s.rounds, s
    for b in backends:  # every forward of both sides went through a step's buffers
        (_, step), = b._steps.values()
        assert len(step.buffers) > 1, step.buffers.keys()


def test_hits_after_a_leaf_was_accepted(pair):
    """An outcome through a leaf (an off-spine slot) was pre-drafted and hit: the drafter glues the whole tree
    and forks candidates at every node."""
    target, draft = pair
    _, s, _ = _loopback_run(target, draft, TreeShape.uniform(3, 2), _prompts(4), 32)
    assert s.hits_off_spine > 0, s


def test_trees_accept_more_per_round_than_chains(pair):
    target, draft = pair
    prompts = _prompts(4)
    _, _, chain = _loopback_run(target, draft, TreeShape(), prompts, 32)
    _, s, tree = _loopback_run(target, draft, TreeShape.uniform(3, 2), prompts, 32)
    assert tree.mean_tokens_per_round > chain.mean_tokens_per_round, (tree.mean_tokens_per_round,
                                                                      chain.mean_tokens_per_round)


def test_a_bundle_built_on_a_backup_round_has_its_own_fan_out(tiny_models):
    """After a backup round the next bundle's fan-out follows the backup's measured acceptance, not the draft's
    (the paper's separate schedule after a miss), and each source's outcomes feed its own estimate."""
    from drafter_service.ssd_drafter import DraftRequest, SSDDrafter

    drafter = SSDDrafter(ModelRunner(tiny_models["llama-noisy"]), SSDConfig(k=3, fanout=FanoutConfig(budget=8),
                                                                            tree=TreeShape()))
    drafter.accept_rate, drafter.backup_accept_rate = 0.9, 0.1
    own = drafter._slot_fanout(Speculation([1, 2, 3], source="cache"))
    backup = drafter._slot_fanout(Speculation([1, 2, 3], source="backup"))
    assert sum(own) == sum(backup) == 8 and backup[0] > own[0], (own, backup)
    req = DraftRequest(Sequence("r", [5, 6, 7], SamplingParams()), 3, base_source="backup")
    before = (drafter.acceptance.value, drafter.backup_acceptance.value)
    drafter.observe(req, OutcomeEvent("r", 1, [1, 2, 3], 0, 9, 3))
    assert drafter.acceptance.value == before[0] and drafter.backup_acceptance.value < before[1]


def test_auto_tree_keeps_leaves_while_they_pay(tiny_models):
    """``--tree auto`` keeps a leaf while its expected tokens beat one more node's measured verify cost."""
    from drafter_service.ssd_drafter import DraftRequest, SSDDrafter

    drafter = SSDDrafter(ModelRunner(tiny_models["llama-noisy"]), SSDConfig(k=3, tree=TreeShape.parse("auto")))
    ceiling = TreeShape.parse("auto").leaves(3)
    assert drafter.leaves_for(3) == ceiling  # no verify cost measured yet
    drafter.accept_rate = 0.6
    drafter.node_cost = 0.0
    free = drafter.leaves_for(3)
    drafter.node_cost = 0.03
    mid = drafter.leaves_for(3)
    drafter.node_cost = 10.0
    dear = drafter.leaves_for(3)
    assert free == ceiling and dear == [0, 0, 0] and free != mid != dear
    assert all(f >= m >= d for f, m, d in zip(free, mid, dear)) and mid[0] >= mid[-1]
    # The leaf-rank estimates learn from outcomes: here the second leaf beside the first spine node was taken.
    tokens, parents = spine_tree([10, 11, 12], [[20, 21], [], []])
    req = DraftRequest(Sequence("r", [5, 6], SamplingParams()), 3)
    r0, r1 = drafter.leaf_rank[0].value, drafter.leaf_rank[1].value
    drafter.observe(req, OutcomeEvent("r", 1, tokens, 1, 9, 3, parents=parents, slot=5))
    assert drafter.leaf_rank[0].value < r0 and drafter.leaf_rank[1].value > r1


def test_greedy_auto_trees_equal_ar(pair):
    target, draft = pair
    prompts = _prompts(4)
    outs, s, _ = _loopback_run(target, draft, TreeShape.parse("auto"), prompts, 24)
    assert outs == greedy_outputs(target, prompts, 24)
    assert s.hits > 0 and s.tree_nodes > 4 * s.rounds, s
