"""Run-ahead drafting (SSD with an expensive draft): the chain bookkeeping on both sides, the codec's chain update,
the strategy choice, and the local two-process loop, greedy exact (equal to the target's own AR) and sampled."""

from __future__ import annotations

import os

import pytest
import torch
from reference_decoding import greedy_outputs

from cluster.local_ssd import LocalSSD
from drafter_service.run_ahead import ChainRequest, reconcile
from protos import codec
from spec_core.config import SamplingParams, SSDConfig, resolve_strategy
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from spec_core.settings import ServiceConfig
from spec_core.speculation import ChainMsg, Speculation
from verifier_service.chain_view import ChainView


def _msg(round_: int, start: int, toks: list[int]) -> ChainMsg:
    return ChainMsg("r", round_, start, Speculation(toks, None, source="chain"))


# ---- the drafter's chain --------------------------------------------------------------------------------------
def test_reconcile_keeps_a_chain_that_predicted_the_outcome() -> None:
    req = ChainRequest(Sequence("r", [1, 2, 3], SamplingParams()), k=3, chain=[4, 5, 6, 7, 8], num_computed=7)
    assert reconcile(req, [4, 5, 6]) == 7
    assert req.seq.token_ids == [1, 2, 3, 4, 5, 6] and req.chain == [7, 8] and req.num_computed == 7


def test_reconcile_cuts_the_chain_where_the_outcome_left_it() -> None:
    req = ChainRequest(Sequence("r", [1, 2, 3], SamplingParams()), k=3, chain=[4, 5, 6, 7], num_computed=6)
    assert reconcile(req, [4, 9]) == 4  # K/V of 1, 2, 3 and the accepted 4 stay; 5's is wrong now
    assert req.seq.token_ids == [1, 2, 3, 4, 9] and req.chain == []


def test_reconcile_with_a_chain_shorter_than_the_outcome() -> None:
    req = ChainRequest(Sequence("r", [1, 2], SamplingParams()), k=3, chain=[3], num_computed=2)
    assert reconcile(req, [3, 4, 5]) == 2
    assert req.chain == [] and req.seq.token_ids == [1, 2, 3, 4, 5]


# ---- the verifier's view --------------------------------------------------------------------------------------
def test_view_follows_updates_and_outcomes() -> None:
    view = ChainView(base=3, tail=[1, 2, 3])
    assert view.take(_msg(-1, 3, [4])) and view.take(_msg(-1, 4, [5])) and view.take(_msg(-1, 5, [6]))
    assert view.take_speculation(2) == ([4, 5], None)
    assert view.commit(0, [4, 5, 6])  # all predicted: the view moves on, keeping its (empty) tail
    assert view.base == 6 and view.tokens == []
    assert view.take(_msg(-1, 6, [7]))  # drafted before the drafter heard of round 0, still on the right base
    assert view.tokens == [7]


def test_view_drops_stale_updates_after_a_miss() -> None:
    view = ChainView(base=3, tail=[1, 2, 3])
    view.take(_msg(-1, 3, [4, 5]))
    assert not view.commit(0, [4, 9])  # a miss at the second token
    assert view.base == 5 and view.need_round == 0
    assert not view.take(_msg(-1, 5, [6]))  # drafted after 5, not 9: stale
    assert view.take(_msg(0, 5, [7]))  # the drafter restarted from the outcome
    assert view.tokens == [7]


def test_view_refuses_gaps_and_contradictions() -> None:
    view = ChainView(base=3, tail=[1, 2, 3])
    assert not view.take(_msg(-1, 5, [6]))  # position 4 never came
    view.take(_msg(-1, 3, [4]))
    assert not view.commit(0, [4, 5])  # the view was shorter than the outcome: it cannot vouch for the rest
    assert view.take(_msg(0, 4, [5, 6, 7]))  # a sync that begins on committed tokens: its head checked, then used
    assert view.tokens == [6, 7]
    assert not view.take(_msg(0, 4, [8, 6]))  # its head contradicts what was committed


def test_chain_update_round_trips_the_codec() -> None:
    probs = torch.softmax(torch.randn(2, 50), dim=-1)
    msg = ChainMsg("r", 4, 17, Speculation([3, 9], probs, source="chain"), busy_s=1.5)
    back = codec.message_from_pb(codec.message_to_pb(msg), 50)
    assert (back.request_id, back.round, back.start, back.speculation.token_ids, back.busy_s) == ("r", 4, 17, [3, 9], 1.5)
    assert torch.allclose(back.speculation.draft_probs, probs)
    with pytest.raises(ValueError):
        codec.message_to_pb(ChainMsg("r", 0, 3, Speculation([1, 2], None, parents=[-1, -1])))


def test_strategy_follows_the_weights_share() -> None:
    assert resolve_strategy("auto", 494, 1544) == "run-ahead"  # Qwen2.5-Coder 0.5B under 1.5B
    assert resolve_strategy("auto", 17, 134) == "fanout"  # the default pair
    assert resolve_strategy("fanout", 494, 1544) == "fanout"
    with pytest.raises(ValueError):
        SSDConfig(strategy="sideways")


# ---- the local two-process loop -------------------------------------------------------------------------------
two_cores = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or os.cpu_count() < 2, reason="needs two cores")


def _run(ssd: LocalSSD, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
    seqs = [Sequence(str(i), p, params) for i, p in enumerate(prompts)]
    for s in seqs:
        ssd.engine.add(s)
    ssd.engine.run()
    ssd.engine.blocks.check_all_free()
    return seqs


@two_cores
@pytest.mark.parametrize("schedule", ["auto", "alternating"])
def test_run_ahead_ssd_is_greedy_exact(tiny_models, schedule) -> None:
    target = ModelRunner(tiny_models["llama"])
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [3, 4]]
    refs = greedy_outputs(target, prompts, 40)
    cfg = ServiceConfig(draft=str(tiny_models["llama-draft"]), k=3, ssd_strategy="run-ahead", fixed_k=True,
                        max_num_seqs=3, run_ahead_schedule=schedule)
    with LocalSSD(target, cfg) as ssd:
        assert ssd.strategy == "run-ahead"
        seqs = _run(ssd, prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert [s.output_ids for s in seqs] == refs
        s = ssd.proposer.stats
        assert s.rounds > 0 and s.hits + s.jit_misses + s.backup_misses == s.rounds
        assert ssd.proposer.drafter_busy_s > 0


@two_cores
def test_run_ahead_ssd_reproduces_a_seeded_sampled_request(tiny_models) -> None:
    """Sampled with a seed: the same tokens twice (the verifier's uniforms are keyed, the drafter's too)."""
    target = ModelRunner(tiny_models["llama"])
    params = SamplingParams(max_new_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    cfg = ServiceConfig(draft=str(tiny_models["llama-draft"]), k=3, ssd_strategy="run-ahead", fixed_k=True,
                        max_num_seqs=2)
    with LocalSSD(target, cfg) as ssd:
        first = _run(ssd, [[5, 6, 7, 8]], params)[0].output_ids
        again = _run(ssd, [[5, 6, 7, 8]], params)[0].output_ids
    assert len(first) == 24 and first == again


@two_cores
def test_the_drafter_borrows_the_verifier_core_while_the_flag_is_up_and_it_pays() -> None:
    import multiprocessing as mp

    from drafter_service.core_borrowing import CoreBorrowing

    cores = sorted(os.sched_getaffinity(0))[:2]
    flag = mp.get_context("spawn").RawValue("b", 0)
    old_aff, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        os.sched_setaffinity(0, {cores[1]})
        torch.set_num_threads(1)
        b = CoreBorrowing(flag, cores[1], cores[0])
        b.before_step()
        assert os.sched_getaffinity(0) == {cores[1]} and b.borrowed_steps == 0
        flag.value = 1
        b.before_step()
        assert os.sched_getaffinity(0) == set(cores) and torch.get_num_threads() == 2 and b.borrowed_steps == 1
        flag.value = 0
        b.before_step()
        assert os.sched_getaffinity(0) == {cores[1]} and torch.get_num_threads() == 1 and b.borrowed_steps == 1
        # measured: two cores slower than one, so a raised flag keeps the drafter on its own core ...
        b.observe(0.010)
        b.step_s[True] = 0.020
        flag.value = 1
        b._steps = 1
        b.before_step()
        assert os.sched_getaffinity(0) == {cores[1]} and b.borrowed_steps == 1
        # ... and two cores faster: it borrows
        b.step_s[True] = 0.006
        b.before_step()
        assert os.sched_getaffinity(0) == set(cores) and b.borrowed_steps == 2
    finally:
        os.sched_setaffinity(0, old_aff)
        torch.set_num_threads(old_threads)


def test_run_ahead_over_grpc_equals_target_greedy(toy_pair, greedy_reference) -> None:
    """The served path: a drafter server told to run ahead, a verifier server that follows its ack, real gRPC."""
    from drafter_service.server import DrafterServer, DrafterServerConfig
    from spec_core.config import ModelConfig, SpeculationConfig
    from verifier_service.client import SSDClient
    from verifier_service.run_ahead_proposer import RunAheadProposer
    from verifier_service.server import VerifierServer, VerifierServerConfig

    prompt = "def add(a, b):\n"
    drafter = DrafterServer(DrafterServerConfig(ModelConfig(toy_pair["draft"]), SSDConfig(k=2, strategy="run-ahead")))
    drafter.start()
    server = VerifierServer(VerifierServerConfig(ModelConfig(toy_pair["target"]),
                                                 spec=SpeculationConfig(k=2, adaptive_k=False)))
    try:
        address = server.start(drafter.address)
        assert isinstance(server.engine_loop.engine.drafter, RunAheadProposer)
        with SSDClient(address) as client:
            out = client.generate_all(prompt, SamplingParams(max_new_tokens=32, ignore_eos=True))
        assert list(out.final.token_ids) == greedy_reference(prompt, 32)
        assert server.stats()["ssd_rounds"] > 0
    finally:
        server.stop()
        drafter.stop()


# ---- the target's distribution at T = 0.8 ---------------------------------------------------------------------
class _RunAheadLoopback:
    """An in-process link to a run-ahead drafter (timing-free, so seeded runs are deterministic): each flush (the
    verifier's, before it verifies) applies the buffered events and drafts ``steps`` batched steps; a poll that
    waits drafts one step (the drafter progressing while the verifier waits for it)."""

    alive = True

    def __init__(self, drafter, steps: int) -> None:
        from drafter_service.run_ahead import RunAheadLoop

        self.out: list[object] = []
        self.events: list[object] = []
        self.steps = steps
        self.loop = RunAheadLoop(drafter, self)

    def send(self, msg: object) -> None:  # both ends: events from the verifier, updates from the drafter loop
        (self.out if isinstance(msg, ChainMsg) else self.events).append(msg)

    def _apply(self, steps: int) -> None:
        events, self.events = self.events, []
        self.loop.handle(events)
        for _ in range(steps):
            self.out.extend(self.loop.drafter.step())

    def flush(self) -> None:
        self._apply(self.steps)

    def poll(self, timeout: float | None = 0.0) -> bool:
        self._apply(1 if timeout and not self.out else 0)
        return bool(self.out)

    def recv(self) -> object:
        return self.out.pop(0)

    def close(self) -> None:
        pass


def _sampled_run(pair, steps: int, false_q: bool = False):
    from test_ssd_distribution import VOCAB, K, sample_requests

    from drafter_service.run_ahead import RunAheadDrafter
    from verifier_service.engine import EngineConfig, VerifierEngine
    from verifier_service.run_ahead_proposer import RunAheadProposer
    from verifier_service.scheduler import SchedulerConfig

    target, draft = pair
    drafter = RunAheadDrafter(draft, SSDConfig(k=K, num_blocks=8192, block_size=8, strategy="run-ahead"))
    if false_q:  # NEGATIVE CONTROL: the verifier is sent q rows, but the tokens are their argmax, not draws
        real = drafter._update

        def lying(req, start, count):
            msg = real(req, start, count)
            q = msg.speculation.draft_probs
            return ChainMsg(msg.request_id, msg.round, msg.start, Speculation(q.argmax(-1).tolist(), q, "chain"))

        drafter._update = lying
    proposer = RunAheadProposer(_RunAheadLoopback(drafter, steps), VOCAB, wait_fraction=0.5, backup_policy="neural")
    engine = VerifierEngine(target, EngineConfig(8192, 8, SchedulerConfig(max_num_seqs=512, max_spec_nodes=K),
                                                 sampling="residual"), drafter=proposer, k=K)
    return sample_requests(engine), proposer.stats


@pytest.mark.parametrize("steps", [5, 1])
def test_run_ahead_ssd_matches_target_distribution(steps) -> None:
    """A drafter far ahead (5 steps a round: rounds hit where the chain survived) and one step behind (rounds
    wait for it)."""
    import test_ssd_distribution as dist

    pair = _distribution_pair()
    out, stats = _sampled_run(pair, steps)
    p = dist.min_pvalue(out, dist.exact_pairs(pair[0]))
    # sampled chains survive a round less often than greedy ones (the bonus must equal the chain's next draw)
    assert stats.rounds > 0 and stats.jit_misses > 0 and (stats.hits > 0.05 * stats.rounds if steps == 5 else True)
    assert p > 1e-3, (p, stats)


def test_control_run_ahead_with_a_false_q_fails() -> None:
    import test_ssd_distribution as dist

    pair = _distribution_pair()
    out, _ = _sampled_run(pair, 5, false_q=True)
    p = dist.min_pvalue(out, dist.exact_pairs(pair[0]))
    assert p < 1e-6, p


_PAIR: list = []


def _distribution_pair():
    """test_ssd_distribution's tiny target and a noisy copy as the draft (built once)."""
    import tempfile
    from pathlib import Path

    from conftest import save_noisy_copy, save_tiny_model
    from test_ssd_distribution import VOCAB

    if not _PAIR:
        base = Path(tempfile.mkdtemp(prefix="run-ahead-dist-"))
        target = save_tiny_model(base / "t", "llama", 31, vocab_size=VOCAB)
        _PAIR.extend([ModelRunner(target), ModelRunner(save_noisy_copy(target, base / "d", 0.15, 8))])
    return _PAIR


def test_a_chain_tail_is_tested_like_a_child_and_keeps_the_last_token_exact() -> None:
    """The round's last token, with a tail drawn from q: distributed as p, and equal to the tail with probability
    sum(min(p, q)) (an independent draw from p would match it with sum(p q))."""
    from scipy.stats import chisquare

    from spec_core.tree import TokenTree, stochastic_verify_tree_path

    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(6, generator=g), -1)
    q = torch.softmax(torch.randn(6, generator=g), -1)
    target = torch.stack([p, p])  # one chain node, always accepted below (q of it one-hot, p of it 1)
    target[0] = torch.nn.functional.one_hot(torch.tensor(2), 6).float()
    counts, same, n = torch.zeros(6), 0, 20000
    for _ in range(n):
        tail = int(torch.multinomial(q, 1, generator=g))
        tree = TokenTree([-1], [2], torch.nn.functional.one_hot(torch.tensor([2]), 6).float(), tail=(tail, q))
        out, path = stochastic_verify_tree_path(target, tree, torch.rand(3, generator=g))
        assert out[0] == 2 and path == [0]
        counts[out[1]] += 1
        same += out[1] == tail
    expected = (p.double() / p.double().sum() * n).tolist()
    assert chisquare(counts.double().tolist(), expected).pvalue > 1e-3
    assert abs(same / n - float(torch.minimum(p, q).sum())) < 0.02
    with pytest.raises(ValueError):
        TokenTree([-1, -1], [1, 2], tail=(3, q))
