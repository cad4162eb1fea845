"""Lifetime counters of the verifier, and the periodic one-line stats log (like vLLM's "Avg prompt throughput ...").

:func:`counter_totals` reads the raw lifetime counts that the Prometheus counters and this log are derived from:
they only ever grow while the server runs (none is reset, not even by a drafter reconnect), so the difference of two
snapshots is the activity between them. Both live here, apart from :mod:`verifier_service.metrics`, so that
``stats()`` needs no Prometheus import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from spec_core.metrics import ratio

logger = logging.getLogger(__name__)


def counter_totals(engine) -> dict:
    """The engine's (and the SSD proposer's) lifetime counts, for ``stats()``.

    ``drafts`` counts rounds that proposed at least one token (vLLM's ``num_drafts``); ``accepted_tokens /
    draft_tokens`` is exactly ``stats()["acceptance_rate"]``; ``accepted_tokens_per_pos[j]`` counts drafts whose
    token at position j (0-based) was accepted. SSD: ``ssd_hits + ssd_jit_misses + ssd_backup_misses == ssd_rounds``.
    """
    d = engine.metrics.stats
    out = {"drafts": d.num_drafts, "draft_tokens": d.num_drafted, "accepted_tokens": d.num_accepted,
           "accepted_tokens_per_pos": list(d.accepted_by_position)}
    s = getattr(engine.drafter, "stats", None)
    if s is not None and hasattr(s, "branches_received"):
        out.update(ssd_jit_misses=s.jit_misses, ssd_backup_misses=s.backup_misses,
                   bundles_received=s.bundles_received, branches_received=s.branches_received,
                   jit_received=s.jit_received)
    return out


#: The snapshot keys whose growth over an interval means there was activity.
_ACTIVITY = ("prompt_tokens", "tokens_emitted", "draft_tokens")


def _delta(now: dict, before: dict, key: str) -> float:
    return float((now.get(key) or 0) - (before.get(key) or 0))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def format_line(now: dict, before: dict, elapsed_s: float) -> str:
    """The log line for the interval between two snapshots (``ServiceMetrics.snapshot()``), ``elapsed_s`` apart."""
    dt = max(elapsed_s, 1e-9)
    accepted, drafted = _delta(now, before, "accepted_tokens"), _delta(now, before, "draft_tokens")
    drafts = _delta(now, before, "drafts")
    parts = [f"Avg prompt throughput: {_delta(now, before, 'prompt_tokens') / dt:.1f} tokens/s",
             f"Avg generation throughput: {_delta(now, before, 'tokens_emitted') / dt:.1f} tokens/s",
             f"Running: {now.get('running', 0)} reqs", f"Waiting: {now.get('queued', 0)} reqs",
             f"KV cache usage: {_pct(now.get('kv_usage') or 0.0)}"]
    if now.get("mode") != "ar":
        length = 1 + accepted / drafts if drafts else None
        parts += [f"Draft acceptance rate: {_pct(ratio(accepted, drafted))}",
                  "Mean acceptance length: " + ("n/a" if length is None else f"{length:.2f}")]
    if now.get("mode") == "ssd":
        hits, rounds = _delta(now, before, "ssd_hits"), _delta(now, before, "ssd_rounds")
        parts.append(f"SSD cache hit rate: {_pct(ratio(hits, rounds))}")
    return ", ".join(parts)


def had_activity(now: dict, before: dict) -> bool:
    """Tokens moved in the interval, or requests are still running or waiting."""
    return any(_delta(now, before, k) > 0 for k in _ACTIVITY) or bool(now.get("running") or now.get("queued"))


class StatsLogger:
    """Logs one INFO line every ``interval_s`` seconds on its own daemon thread, only after an interval with
    activity. The rates are over the interval (differences of lifetime totals), the gauges are the current ones."""

    def __init__(self, snapshot: Callable[[], dict], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"stats_log_interval_s must be > 0, got {interval_s}")
        self.snapshot = snapshot
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._last = snapshot()
        self._last_t = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="verifier-stats-log", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)

    def log_once(self) -> str | None:
        """Log the interval since the previous call (returns the line, or None when it was idle)."""
        now, t = self.snapshot(), time.monotonic()
        before, elapsed = self._last, t - self._last_t
        self._last, self._last_t = now, t
        if not had_activity(now, before):
            return None
        line = format_line(now, before, elapsed)
        logger.info("%s", line)
        return line

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.log_once()
            except Exception:  # noqa: BLE001 - a stats line is never worth the server
                logger.exception("stats log failed")
