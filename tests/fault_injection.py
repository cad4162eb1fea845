"""Faults and negative controls the tests inject into real parts: a slow verifier, a slow or forgetful drafter
(in this process or in the local pair's drafter process), a drafter that ships the wrong proposal rows.

The product has no switch for any of them; each wraps or subclasses the real object, so everything else runs as
users run it.
"""

from __future__ import annotations

import functools
import time

from drafter_service.ssd_drafter import SSDDrafter
from spec_core.sampling import request_probs
from spec_core.tree import TokenTree
from spec_core.tree_batch import tree_outcomes
from verifier_service.ssd_proposer import SSDProposer
from verifier_service.target_rows import coupled_rows


def slow_verifier(engine, delay_s: float) -> None:
    """Every forward of ``engine``'s target takes ``delay_s`` longer (inside its timer, so the engine measures it)."""
    forward = engine.backend.forward_paged

    def slow(*args, **kwargs):
        out = forward(*args, **kwargs)
        time.sleep(delay_s)
        return out

    engine.backend.forward_paged = slow


class ForgetfulDrafter(SSDDrafter):
    """Ships every bundle empty, so every round misses (the forced-miss regime: just-in-time drafts or the backup)."""

    def build_bundles(self, reqs, specs, send=None):
        bundles = super().build_bundles(reqs, specs)
        for bundle in bundles:
            bundle.entries = {}
            if send is not None:
                send(bundle)
        return bundles


class RawQDrafter(SSDDrafter):
    """NEGATIVE CONTROL: draws from Saguaro's q′ but ships the raw q, which breaks exactness when C < 1."""

    def _pick_rows(self, req, logits, positions):
        toks, q, ranked = super()._pick_rows(req, logits, positions)
        if q is None:
            return toks, q, ranked
        return toks, request_probs(logits[None], [req.seq.params])[0], ranked


def _slow_build(drafter_class: type[SSDDrafter], delay_s: float) -> type[SSDDrafter]:
    class Slow(drafter_class):
        def build_bundles(self, reqs, specs, send=None):
            time.sleep(delay_s)
            return super().build_bundles(reqs, specs, send)

    return Slow


def _drafter_main(conn, config, flags=None, *, bundle_delay_s: float = 0.0, forgetful: bool = False) -> None:
    """The local pair's drafter process with its drafter slowed by ``bundle_delay_s`` before every bundle build,
    and/or ``forgetful`` (:class:`ForgetfulDrafter`). Runs in the spawned process."""
    from drafter_service import process

    cls = ForgetfulDrafter if forgetful else SSDDrafter
    process.SSDDrafter = _slow_build(cls, bundle_delay_s) if bundle_delay_s else cls
    process.drafter_process_main(conn, config, flags)


def drafter_main(bundle_delay_s: float = 0.0, forgetful: bool = False):
    """An entry point for :class:`cluster.local_ssd.LocalSSD`'s drafter process (picklable)."""
    return functools.partial(_drafter_main, bundle_delay_s=bundle_delay_s, forgetful=forgetful)


def late_drafter_loop(monkeypatch, delay_s: float) -> None:
    """Every drafter loop in this process sleeps ``delay_s`` before each batch of events, so just-in-time drafts
    are late too (a drafter slowed by other work)."""
    from drafter_service.process import DrafterLoop

    handle = DrafterLoop.handle

    def late(self, events):
        time.sleep(delay_s)
        handle(self, events)

    monkeypatch.setattr(DrafterLoop, "handle", late)


class GreedyMatchBackupProposer(SSDProposer):
    """NEGATIVE CONTROL: verifies a sampled request's backup chain by greedy match (biased at T > 0)."""

    def _backup_tree(self, seq, tokens):
        if seq.params.deterministic:
            return super()._backup_tree(seq, tokens)
        return TokenTree(list(range(-1, len(tokens) - 1)), tokens, None, greedy_match=True)


def without_sibling_recursion(monkeypatch) -> None:
    """NEGATIVE CONTROL: the engine tests every sibling of a sampled tree against the original target row (biased)."""
    from verifier_service import target_rows

    monkeypatch.setattr(target_rows, "tree_outcomes", functools.partial(tree_outcomes, sibling_recursion=False))


def coupling_without_position(monkeypatch) -> None:
    """NEGATIVE CONTROL: the engine keys a coupled request's races by its seed alone (one noise for all its tokens,
    so they are correlated: biased)."""
    from verifier_service import engine

    monkeypatch.setattr(engine, "coupled_rows", functools.partial(coupled_rows, by_position=False))
