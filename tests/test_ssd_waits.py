"""The SSD proposer's side of adaptive speculation: which rounds no hit could serve, the fast backup's wait for a
bundle in the making, empty backup rounds in its tokens per round, and the backup choice at b*."""

from __future__ import annotations

import math

import pytest
from outbox import Outbox

from spec_core.config import SamplingParams
from spec_core.sequence import Sequence
from verifier_service.ssd_proposer import SSDProposer


def test_a_cold_request_is_one_no_hit_could_serve() -> None:
    """:meth:`SSDRequestState.cold`: before its first hit (the drafter catches up on the prompt), or in a round
    whose bundle nobody asked for (the round before it was plain); only the latter skips the wait for a draft
    (:meth:`SSDRequestState.draft_can_come`)."""
    from verifier_service.ssd_request import SSDRequestState

    st = SSDRequestState(round=5, asked={4})
    assert st.cold()  # no hit yet
    st.warm = True
    assert not st.cold()
    assert st.draft_can_come()  # asked for: a wait for its draft can pay
    st.asked = {5}  # the bundle for round 4 was never asked (a plain round 4, now re-probed)
    assert st.cold() and not st.draft_can_come()  # the backup serves it at once


def test_bundle_wait_is_break_even() -> None:
    """The fast backup's wait for a bundle in the making (:func:`bundle_wait`): as long as the observed lateness
    says it pays, never past the cap, not where a bundle's round gains nothing, and shared by the batch."""
    from verifier_service.ssd_stats import SSDStats, bundle_gain, bundle_wait

    assert bundle_gain(SSDStats()) == pytest.approx(1.0)  # priors: 2 tokens against 1
    good = SSDStats(hit_rounds=50, tokens_on_hit=125, backup_rounds=50, tokens_on_backup=100)
    assert bundle_gain(good) == pytest.approx((129 / 52) / (102 / 52) - 1)
    assert bundle_gain(SSDStats(hit_rounds=50, tokens_on_hit=100, backup_rounds=50, tokens_on_backup=110)) < 0
    late = [0.03 + 0.001 * i for i in range(10)]  # bundles 30-39 ms late; a verify takes 200 ms
    assert bundle_wait(late, 1.0, 0.2, 0.1) == pytest.approx(0.042)  # wait for all of them (+ 3 ms transit)
    assert bundle_wait(late, 1.0, 0.2, 0.0375) == pytest.approx(0.037)  # the cap: only the first five
    assert bundle_wait(late, 0.0, 0.2, 0.1) == 0.0 and bundle_wait([], 1.0, 0.2, 0.1) == 0.0
    assert bundle_wait(late, 1.0, 0.2, 0.02) == 0.0  # all later than the cap
    # a gain of 10% pays for at most 20 ms of a 200 ms verify: no wait for bundles 30 ms late
    assert bundle_wait(late, 0.1, 0.2, 0.1) == 0.0
    # mostly never: a few bundles in time are not worth a 20% gain
    assert bundle_wait([0.03, math.inf, math.inf, math.inf, math.inf], 0.2, 0.2, 0.1) == 0.0
    # the whole batch waits for one request of 16: 30 ms is 15% of a round, for a gain of 1/16 round
    assert bundle_wait(late, 1.0, 0.2, 0.1, share=1 / 16) == 0.0


def test_an_empty_backup_round_counts_in_the_fast_backups_tokens_per_round() -> None:
    """A speculating round the n-gram backup found nothing for still made a token: it counts in e_fast (the
    backup policy's and the bundle wait's measure of the fast backup) at 1 token, not as no round at all."""
    from verifier_service.ssd_request import SSDRequestState

    prop = SSDProposer(link=Outbox(), vocab_size=50, backup_policy="fast")
    fresh = prop.stats.e_fast()
    for rid, prompt in (("empty", [1, 2, 3, 4]), ("match", [1, 2, 3, 1])):  # no repeat / "1" repeats: 2, 3 follow
        seq = Sequence(rid, prompt, SamplingParams(max_new_tokens=8))
        prop.state[rid] = SSDRequestState(round=1)
        tree = prop._to_tree(seq, 2, None)
        assert tree.num_nodes == (0 if rid == "empty" else 2)
        n = seq.num_tokens
        path = [0, 1] if tree.num_nodes else []
        seq.append([*tree.token_ids, 7])  # the accepted path, then the bonus
        prop.commit(seq, n, tree, path, 2)
    s = prop.stats
    assert s.backup_rounds == 2 and s.tokens_on_backup == 1 + 3 and s.backup_misses == 2
    assert s.e_fast() == pytest.approx((4 + 2) / (2 + 2)) and fresh == pytest.approx(1.0)
    assert s.accepted_hist[0] == 1 and s.mean_tree_nodes == pytest.approx(1.0)


def test_backup_choice_flips_at_b_star() -> None:
    prop = SSDProposer(link=None, vocab_size=10, backup_policy="auto")
    s = prop.stats
    s.rounds, s.hits = 100, 80
    s.hit_rounds, s.tokens_on_hit = 80, 240
    s.jit_rounds, s.tokens_on_jit, s.jit_wait_s = 20, 60, 20 * 0.4 * 0.01  # JIT costs 0.4 verify
    s.jit_attempt_rounds, s.tokens_on_jit_attempts = 20, 60
    s.backup_rounds, s.tokens_on_backup = 10, 15
    prop.verify_s_ema = 0.01
    choices = {b: prop.choose_backup(b) for b in (1, 2, 4, 8, 16, 32, 64)}
    assert choices[1] == "neural" and choices[64] == "fast"
    flip = min(b for b, c in choices.items() if c == "fast")
    assert all(c == "neural" for b, c in choices.items() if b < flip)
    assert all(c == "fast" for b, c in choices.items() if b >= flip)
    # a cheaper JIT (injected) moves b* up
    s.jit_wait_s = 20 * 0.05 * 0.01
    assert prop.choose_backup(flip) == "neural"
    assert SSDProposer(link=None, vocab_size=10, backup_policy="fast").choose_backup(1) == "fast"
