"""Coupled sampling (spec_core.coupling): each pick is an exact draw (chi-square, with the head small enough that the
tail's racer wins often; the head-only race is the negative control and must fail), a function of (seed, position)
alone, the same integers on every path; and the drafter's race picks the verifier's token when the two
distributions agree."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from drafter_service.picking import race_ranking
from spec_core.config import SamplingParams
from spec_core.coupling import _mix, coupled_picks, coupling_keys, keyed_uniforms, race_scores
from spec_core.sequence import Sequence

V = 300
N = 40_000


def _dist(seed: int = 0, scale: float = 2.5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=gen, dtype=torch.float64) * scale, -1).float()


def _pvalue(picks: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(picks, minlength=V).double()
    expected = p.double() / p.double().sum() * picks.numel()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:  # no small bins with mass: nothing to pool (a zero-probability pick fails the caller's check)
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


def test_coupled_picks_are_exact_draws_and_the_head_only_race_is_not():
    p = _dist()
    probs = p.expand(N, V).contiguous()
    keys = torch.tensor(coupling_keys(7, range(N)))
    for head in (4, 64):  # at 4 the tail's racer wins about half the time
        picks = torch.tensor(coupled_picks(probs, keys, head=head))
        tail_share = 1 - torch.isin(picks, p.topk(head).indices).double().mean().item()
        print(f"head {head}: tail won {tail_share:.3f}, p {_pvalue(picks, p):.3g}")
        assert _pvalue(picks, p) > 1e-3
    assert tail_share > 0.02  # head 64 still exercised the tail
    control = race_scores(probs, keys, head=4).argmax(-1)  # the drafter's guess: no tail, so never exact
    assert _pvalue(control, p) < 1e-6


def test_picks_depend_on_seed_and_position_only():
    p = _dist(1).expand(64, V).contiguous()
    keys = torch.tensor(coupling_keys(3, range(64)))
    assert coupled_picks(p, keys) == coupled_picks(p.clone(), keys.clone())
    again = torch.tensor(coupling_keys(3, [5] * 64))  # one position for every row: one noise, one token
    assert len(set(coupled_picks(p, again))) == 1
    assert coupling_keys(3, [5]) != coupling_keys(4, [5]) and coupling_keys(3, [5]) != coupling_keys(3, [6])


def test_host_and_device_paths_give_the_same_uniforms():
    keys = torch.tensor(coupling_keys(11, range(9)))
    ids = torch.randint(0, 2**31 - 1, (9, 70), generator=torch.Generator().manual_seed(2))
    x = _mix(_mix(ids ^ keys[:, :1]) ^ keys[:, 1:])  # the int64 path devices take
    device_path = ((x >> 9).float() + 0.5) * 2.0**-23
    host = keyed_uniforms(keys, ids)
    assert torch.equal(host, device_path)
    assert 0 < host.min() and host.max() < 1


def test_the_drafters_race_picks_the_verifiers_token_when_they_agree():
    """Same distribution on both sides: the drafter's head race wins whenever the verifier's head wins."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(200, V, generator=gen) * 4
    params = SamplingParams(temperature=0.8, seed=9, coupled=True)
    seq = Sequence("r", [1, 2, 3], params)
    positions = list(range(10, 210))
    drafted = [row[0] for row in race_ranking(seq, logits, positions, head=32)]
    probs = torch.softmax(logits / 0.8, -1)
    verified = coupled_picks(probs, torch.tensor(coupling_keys(9, positions)), head=32)
    in_head = [v in set(probs[i].topk(32).indices.tolist()) for i, v in enumerate(verified)]
    agree = [d == v for d, v, h in zip(drafted, verified, in_head) if h]
    assert len(agree) > 150 and all(agree)


def test_filtered_tokens_never_win_and_the_rest_stay_exact():
    """Under top-k or top-p most tokens have probability 0. With all the mass in the head, the tail's estimated
    mass (1 - the head's) is rounding error; where its racer 'wins' on it, the head's winner stands."""
    p = torch.zeros(V)
    p[[7, 100, 299]] = torch.tensor([0.5, 0.3, 0.2])
    probs = p.expand(N // 4, V).contiguous()
    keys = torch.tensor(coupling_keys(13, range(N // 4)))
    for head in (2, 64):  # the tail holds one live token, or none
        picks = torch.tensor(coupled_picks(probs, keys, head=head))
        assert set(picks.tolist()) <= {7, 100, 299}
        assert _pvalue(picks, p) > 1e-3


def test_the_device_race_is_the_host_race():
    """A GPU runs :func:`coupled_picks`' race in torch, with every row's tail pick made beside it, a CPU in numpy,
    drawing tails only where they won: on host tensors both give the same draws (the GPU check compares the two
    across devices)."""
    from spec_core.coupling import _race_device, _race_host, _with_tails

    gen = torch.Generator().manual_seed(6)
    probs = torch.softmax(torch.randn(500, V, generator=gen) * 2, -1)
    keys = torch.tensor(coupling_keys(21, range(500)))
    hv, ids = probs.topk(8, dim=-1)
    mass = (1.0 - hv.double().sum(-1)).clamp(min=0.0).float()
    picks, won, u_pick = _race_host(keys, hv, ids, mass)
    with_tails = _with_tails(probs, ids, u_pick, list(picks), won)
    assert _race_device(keys, probs, hv, ids, mass).tolist() == with_tails
    assert sum(won) > 10 and sum(a != b for a, b in zip(picks, with_tails)) > 10  # tails won and were drawn
