"""Coupled sampling: a sampled token that is a function of (seed, position, distribution), drawn exactly.

A coupled request's token at position t is the winner of an *exponential race* over the target's distribution p
there (after temperature, top-k and top-p): every token v runs with time E_v / p_v, E_v ~ Exp(1), and the fastest
wins, which happens with probability exactly p_v. The E_v come from a hash of (the request's seed, t, v), so they
are fresh at every position (independent of the prefix that produced p) and the same on every device and process
that computes them. Two consequences:

- **Drafter invariance.** The verifier's token at t depends only on p and the seed, never on what was drafted, the
  round, the batch or the timing. So verification is an argmax match (as for greedy requests), drafts need no q
  rows, the n-gram backup is as exact as the neural draft, and a seeded request is reproducible in every regime.
- **Predictable outcomes.** The drafter runs the same race over its own q with the same E_v. Its winner is the
  target's whenever q and p agree on the race (on the real pair at T = 0.8: 0.35 of positions, against 0.37 for
  the residual rule's 1 - TV), and after a rejection its next racers are its guesses at the bonus token: SSD's
  outcome prediction works as it does for greedy requests, where the residual rule's bonus is a fresh draw.

The race is run over the ``head`` likeliest tokens one by one, and over the rest as one racer: the minimum of
independent Exp(p_v) times over the tail is Exp(P(tail)), and the tail's winner is distributed as p within the tail,
so an inverse-CDF draw there (its own keyed uniform) picks it. Which tokens form the head depends only on p, so the
draw stays exact; it only couples the two sides' races less where a token is in one side's head and not the other's.

:func:`coupled_picks` gives the verifier's exact draws. :func:`race_scores` gives the drafter's race (the head only:
a guess need not be exact) as scores, log p_v - log E_v for the racers and -inf elsewhere: their argmax is the
head's winner and their order the race's, so the greedy code paths (top-n leaves and bonus candidates) run on them
unchanged.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spec_core.sampling import sample_from_probs
from spec_core.transfer import HostCopy, to_device, to_host

#: Tokens raced one by one; the rest race as one (module docstring).
COUPLE_HEAD = 64
_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**31, so a 32-bit value times it stays inside int64
_TAIL_TIME, _TAIL_PICK = 0x7FFFFFFF, 0x7FFFFFFE  # hash inputs of the tail's race time and its inverse-CDF draw
_PURPOSE = 0xC0


def coupling_keys(seed: int, positions: Sequence[int]) -> list[list[int]]:
    """Per position, the two 32-bit words that key its race (BLAKE2b of seed and position)."""
    out = []
    for t in positions:
        digest = hashlib.blake2b(struct.pack("<QQ", seed % (1 << 64), (_PURPOSE << 40) | t), digest_size=8).digest()
        lo, hi = struct.unpack("<II", digest)
        out.append([lo, hi])
    return out


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply) on int64 tensors holding values below 2**32."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def _mix_np(x: np.ndarray) -> np.ndarray:
    """:func:`_mix` on uint32 arrays (whose products wrap modulo 2**32, as the int64 path masks them)."""
    x = ((x >> 16) ^ x) * np.uint32(_MUL)
    x = ((x >> 16) ^ x) * np.uint32(_MUL)
    return (x >> 16) ^ x


def keyed_uniforms(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) (23 bits, never 0 or 1) for ``ids [N, M]`` (int64, < 2**31) under ``keys [N, 2]``. The
    same integers on every device: host tensors take a numpy path (a few dozen small torch ops cost more than the
    top-k they follow), device tensors stay on their device."""
    if ids.device.type == "cpu":
        k = keys.numpy().astype(np.uint32)
        x = _mix_np(_mix_np(ids.numpy().astype(np.uint32) ^ k[:, :1]) ^ k[:, 1:])
        return torch.from_numpy(((x >> 9).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23))
    x = _mix(_mix(ids ^ keys[:, :1]) ^ keys[:, 1:])
    return ((x >> 9).float() + 0.5) * 2.0**-23


def _tail_ids(keys: torch.Tensor) -> torch.Tensor:
    """``[N, 2]``: the hash inputs of the tail's race time and of its inverse-CDF pick."""
    n = keys.shape[0]
    return torch.cat([torch.full((n, 1), _TAIL_TIME, dtype=torch.long, device=keys.device),
                      torch.full((n, 1), _TAIL_PICK, dtype=torch.long, device=keys.device)], dim=1)


def _head_race_scores(keys: torch.Tensor, hv: torch.Tensor, ids: torch.Tensor, tail: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(scores ``[N, H]`` = log p_v - log E_v of the head tokens ``ids`` with probabilities ``hv``, their ids, and
    with ``tail`` the uniforms ``[N, 2]`` of the tail's race time and of its inverse-CDF pick), one hash call."""
    h = ids.shape[1]
    u = keyed_uniforms(keys, torch.cat([ids, _tail_ids(keys)], dim=1) if tail else ids)
    return torch.log(hv) - torch.log(-torch.log(u[:, :h])), ids, u[:, h:] if tail else None


@dataclass(slots=True)
class PendingPicks:
    """:func:`queue_picks`' draws around a step's one download: on a device they are queued on the step's
    :class:`~spec_core.transfer.HostCopy`; on a CPU they are already on the host."""

    host: list[int] | None = None
    slot: int | None = None

    def read(self, down: HostCopy) -> list[int]:
        return self.host if self.host is not None else down[self.slot]


def queue_picks(probs: torch.Tensor, keys: torch.Tensor, down: HostCopy, head: int | None = None) -> PendingPicks:
    """The exact coupled draw of each row of ``probs [N, V]`` (rows sum to 1) under ``keys [N, 2]`` (int64, on the
    probs' device), read after ``down``'s fetch: the head's winner, or where the tail's one racer is faster, the
    tail's inverse-CDF pick. On a device every row's tail pick is made beside its race, so the draws come down in
    the step's one download; on a CPU only the rows whose tail won draw it (about as often as the tail has mass).
    ``head``: default :data:`COUPLE_HEAD`."""
    hv, ids = probs.topk(min(head or COUPLE_HEAD, probs.shape[-1]), dim=-1)
    # The tail's mass as 1 - the head's (no pass over the vocabulary; off by the rows' rounding, ~1e-7). Where the
    # tail is in fact empty (under top-k) and its racer "wins" on that rounding, the head's winner stands.
    mass = (1.0 - hv.double().sum(-1)).clamp(min=0.0).float()
    if probs.device.type == "cpu":  # the same arithmetic in numpy: a few dozen small torch ops cost 0.15 ms a step
        picks, won, u_pick = _race_host(keys, hv, ids, mass)
        return PendingPicks(host=_with_tails(probs, ids, u_pick, picks, won))
    return PendingPicks(slot=down.add(_race_device(keys, probs, hv, ids, mass)))


def coupled_picks(probs: torch.Tensor, keys: torch.Tensor, head: int | None = None) -> list[int]:
    """:func:`queue_picks` on its own, on the host."""
    down = HostCopy()
    pending = queue_picks(probs, keys, down, head)
    down.fetch()
    return pending.read(down)


def _with_tails(probs: torch.Tensor, ids: torch.Tensor, u_pick: torch.Tensor, picks: list[int],
                tail_won: list[bool]) -> list[int]:
    """``picks`` with each row whose tail's racer won replaced by the tail's inverse-CDF pick (where it has mass)."""
    tail_rows = [i for i, won in enumerate(tail_won) if won]
    if tail_rows:
        rows = to_device(tail_rows, probs.device, torch.long)
        tail = probs[rows].scatter(-1, ids[rows], 0.0)
        drawn = torch.stack([sample_from_probs(tail, u_pick[rows]), (tail.sum(-1) > 0).long()], dim=1)
        for i, (t, nonempty) in zip(tail_rows, to_host(drawn)):
            if nonempty:
                picks[i] = int(t)
    return picks


def _race_device(keys: torch.Tensor, probs: torch.Tensor, hv: torch.Tensor, ids: torch.Tensor, mass: torch.Tensor
                 ) -> torch.Tensor:
    """:func:`queue_picks`' draws ``[N]`` in torch, on the probabilities' device, nothing downloaded: the head's
    winner, or where the tail's racer beat it and the tail has mass, the tail's inverse-CDF pick (made for every
    row: a pass over the vocabulary costs a device less than a download of its own)."""
    scores, _, u = _head_race_scores(keys, hv, ids)
    best, at = scores.max(-1)
    tail_score = torch.log(mass) - torch.log(-torch.log(u[:, 0]))  # -inf for an empty tail
    tail = probs.scatter(-1, ids, 0.0)
    use_tail = (tail_score > best) & (tail.sum(-1) > 0)
    return torch.where(use_tail, sample_from_probs(tail, u[:, 1]), ids.gather(-1, at[:, None])[:, 0])


def _race_host(keys: torch.Tensor, hv: torch.Tensor, ids: torch.Tensor, mass: torch.Tensor
               ) -> tuple[list[int], list[bool], torch.Tensor]:
    """:func:`queue_picks`' race on host tensors, in numpy: (head winners, whether the tail's racer beat them,
    the tail picks' uniforms)."""
    h = ids.shape[1]
    u = keyed_uniforms(keys, torch.cat([ids, _tail_ids(keys)], dim=1)).numpy()
    with np.errstate(divide="ignore"):
        scores = np.log(hv.numpy()) - np.log(-np.log(u[:, :h]))
        tail_score = np.log(mass.numpy()) - np.log(-np.log(u[:, h]))
    at = scores.argmax(-1)
    rows = np.arange(len(at))
    return ids.numpy()[rows, at].tolist(), (tail_score > scores[rows, at]).tolist(), torch.from_numpy(u[:, h + 1])


def race_scores(probs: torch.Tensor, keys: torch.Tensor, head: int = COUPLE_HEAD) -> torch.Tensor:
    """The drafter's race as scores ``[N, V]``: the head's (:func:`coupled_picks` without the tail, so its winner
    is the verifier's draw whenever the head wins there and the two distributions agree), -inf elsewhere."""
    hv, hi = probs.topk(min(head, probs.shape[-1]), dim=-1)
    scores, ids, _ = _head_race_scores(keys, hv, hi, tail=False)
    return torch.full_like(probs, float("-inf")).scatter_(-1, ids, scores)


def keys_tensor(seed: int, positions: Sequence[int], device: torch.device) -> torch.Tensor:
    """:func:`coupling_keys` on ``device`` (one upload)."""
    return to_device(coupling_keys(seed, positions), device, torch.long)
