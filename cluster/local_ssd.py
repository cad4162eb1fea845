"""Local two-process SSD: the verifier engine here (pinned to one core), the drafter in its own process (another).

The two exchange outcomes and speculations over a pipe (:class:`drafter_service.process.PipeLink`), the same
interface the gRPC transport implements, so the loop is tested and measured without Ray.

A dead drafter process (killed, crashed) is seen by the link at once: every round then runs on the backup, while a
watcher thread starts a new drafter process; the engine switches to it between steps, and every request in flight
re-prefills there, as a reconnected gRPC drafter does.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafter_service.process import DrafterProcessConfig, drafter_process_main, spawn_drafter
from protos import codec
from spec_core.arch import decode_params
from spec_core.config import draft_dtype
from spec_core.core_flags import CoreFlags
from spec_core.runner import ModelRunner
from spec_core.settings import ServiceConfig
from verifier_service.core_lending import core_lending
from verifier_service.engine import VerifierEngine
from verifier_service.engine_builder import EnginePlan, build_engine
from verifier_service.run_ahead_proposer import RunAheadProposer
from verifier_service.run_ahead_schedule import ALTERNATING, RunAheadSchedule
from verifier_service.ssd_proposer import SSDProposer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LocalPlacement:
    """Where the local pair's two processes run and what each holds: what ``ssd serve``'s launcher decides for its
    actors (cores, KV pools, the draft runner's CPU options), not a setting of the pair (those are the one
    configuration's, :class:`~spec_core.settings.ServiceConfig`)."""

    verifier_core: int | None = 0
    drafter_core: int | None = 1
    #: The verifier's KV pool.
    num_blocks: int = 2048
    block_size: int = 16
    #: The drafter's KV pool (None: :class:`~spec_core.config.SSDConfig`'s).
    drafter_blocks: int | None = None
    #: The drafter process's device (None: the target's).
    draft_device: str | None = None
    #: Row padding for the drafter's runner (:mod:`spec_core.backends.cpu.row_padding`).
    draft_pad_rows: bool = True
    #: The compiled small ops for the drafter's runner (:mod:`spec_core.backends.cpu.cpu_kernels`).
    draft_cpu_kernels: bool = True
    #: The draft head's vocabulary (``ModelConfig.head_vocab``; None: auto, :mod:`spec_core.draft_vocab`).
    draft_head_vocab: int | None = None
    #: How often the watcher checks the drafter process (and restarts it if it died); 0 = never restart.
    restart_interval_s: float = 0.5

    def drafter_pool(self) -> dict:
        """The drafter's pool as :meth:`ServiceConfig.ssd_config` takes it."""
        if self.drafter_blocks is None:
            return {}
        return {"num_blocks": self.drafter_blocks, "block_size": self.block_size}


class LocalSSD:
    """Context manager owning the drafter process and an SSD-driven :class:`VerifierEngine`."""

    def __init__(self, target: ModelRunner, config: ServiceConfig, placement: LocalPlacement | None = None,
                 eos_ids: tuple[int, ...] = (), drafter_main: Callable = drafter_process_main) -> None:
        """The pair runs ``config``'s speculation and engine settings, as ``ssd serve`` would (K, budget, C, tree,
        strategy, adaptive K, the backup and its policy, sampling, batch size, the draft and its dtype, lending);
        ``placement``: this path's processes; ``drafter_main``: the drafter process's entry point (a picklable
        callable with :func:`~drafter_service.process.drafter_process_main`'s signature)."""
        self.target = target
        self.config = config
        self.placement = placement or LocalPlacement()
        self.ssd = config.ssd_config(**self.placement.drafter_pool())
        self.speculation = config.speculation()
        self.draft_path = config.draft or config.model_paths()[1]
        self.eos_ids = eos_ids
        self.drafter_main = drafter_main
        self._old_affinity: set[int] | None = None
        self._old_threads = torch.get_num_threads()
        self.proc = None
        self.link = None
        self.drafter_info: dict = {}
        self.engine: VerifierEngine | None = None
        #: Drafter processes started after the first one died.
        self.restarts = 0
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        #: How the run-ahead verifier and its drafter lend each other their cores (shared memory).
        self._flags = CoreFlags.new()

    def _spawn(self) -> None:
        place, ssd, sp = self.placement, self.ssd, self.speculation
        hello = codec.make_hello("", self.target.vocab_size, ssd.k, ssd.fanout.budget,
                                 codec.sampling_mode(ssd.saguaro_c, ssd.fanout.kind, ssd.tree), sp.backup,
                                 sp.wait_fraction, target_params=decode_params(self.target.hf_config))
        lend = place.verifier_core if self.config.lend_cores and self.target.device.type == "cpu" else None
        self.proc, self.link, self.drafter_info = spawn_drafter(
            DrafterProcessConfig(self.draft_path, ssd, core=place.drafter_core,
                                 dtype=self.config.draft_dtype or self._default_draft_dtype(),
                                 device=place.draft_device or str(self.target.device), pad_rows=place.draft_pad_rows,
                                 cpu_kernels=place.draft_cpu_kernels, lend_core=lend,
                                 head_vocab=place.draft_head_vocab, cuda_graphs=self.target.cuda_graphs),
            hello, flags=self._flags, main=self.drafter_main,
        )

    def _default_draft_dtype(self) -> str:
        """The target's dtype, or for a weight-only target (int4, int8) the draft's own default (``draft_dtype``)."""
        return draft_dtype(self.target.weights or str(self.target.dtype).removeprefix("torch."),
                           self.target.kernels is not None, self.draft_path)

    def _watch(self) -> None:
        """Restart a dead drafter process; the proposer switches to the new link at its next step."""
        while not self._stopping.wait(self.placement.restart_interval_s):
            if self.link.alive or self.proposer.pending_link is not None:
                continue
            old_link, code = self.link, self.proc.exitcode
            logger.warning("drafter process died (exit code %s); starting a new one (backup meanwhile)", code)
            try:
                self._spawn()
            except RuntimeError as exc:
                logger.warning("drafter restart failed: %s", exc)
                continue
            old_link.close(timeout_s=0.1)
            self.restarts += 1
            self.proposer.pending_link = self.link

    def __enter__(self) -> LocalSSD:
        cfg, place, sp = self.config, self.placement, self.speculation
        self._spawn()
        if place.verifier_core is not None and hasattr(os, "sched_setaffinity"):
            self._old_affinity = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {place.verifier_core})
        torch.set_num_threads(1)
        common = dict(backup=sp.backup, wait_fraction=sp.wait_fraction, backup_policy=sp.backup_policy,
                      device=self.target.device, max_nodes=self.ssd.max_nodes)
        if self.strategy == "run-ahead":
            proposer = RunAheadProposer(self.link, self.target.vocab_size, flags=self._flags,
                                        schedule=RunAheadSchedule(mode=sp.run_ahead_schedule), **common)
        else:
            proposer = SSDProposer(self.link, self.target.vocab_size, **common)
        plan = EnginePlan(place.num_blocks, place.block_size, cfg.max_num_seqs, k=sp.k,
                          max_spec_nodes=self.ssd.max_nodes, sampling=sp.sampling, adaptive_k=sp.adaptive_k)
        if sp.adaptive_k and self.strategy == "run-ahead":
            logger.info("run-ahead drafting keeps K fixed at %d (the planner's costs model a fan-out drafter)", sp.k)
        lending = (core_lending(place.verifier_core, self.drafter_info.get("affinity", []), self.target)
                   if cfg.lend_cores else None)
        self.engine = build_engine(self.target, plan, proposer, lending)
        if self.engine.lending is not None:
            with self.engine.lending.lent():
                self.target.row_padding()  # measured per thread count: now, not in the first lent step
        if place.restart_interval_s > 0:
            self._watcher = threading.Thread(target=self._watch, name="drafter-watch", daemon=True)
            self._watcher.start()
        return self

    @property
    def strategy(self) -> str:
        """What the drafter runs: ``fanout`` or ``run-ahead`` (:data:`spec_core.config.SSD_STRATEGIES`)."""
        return self.drafter_info.get("strategy", "fanout")

    @property
    def proposer(self) -> SSDProposer:
        assert self.engine is not None
        return self.engine.drafter

    def __exit__(self, *exc) -> None:
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout=30)
        if self.link is not None:
            self.link.close(timeout_s=1.0)  # the drafter reads EOF and exits
        if self.proc is not None:
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
        if self._old_affinity is not None:
            os.sched_setaffinity(0, self._old_affinity)
        torch.set_num_threads(self._old_threads)


def generate_ssd(local: LocalSSD, prompt_ids: list[int], params, request_id: str = "0"):
    """Run one request through a started :class:`LocalSSD`; returns (sequence, its stats, SSD counters)."""
    from spec_core.sequence import Sequence
    from verifier_service.api import run_one

    assert local.engine is not None
    seq = Sequence(request_id, list(prompt_ids), params, eos_ids=local.eos_ids,
                   max_len=local.target.spec.max_positions)
    before = _snapshot(local)
    stats = run_one(local.engine, seq)
    after = _snapshot(local)
    delta = {k: after[k] - before[k] for k in after}
    ssd = {
        "cache_hit_rate": delta["hits"] / delta["rounds"] if delta["rounds"] else None,
        "verifier_wait_s": delta["wait_s"],
        "backup_rounds": delta["backup"],
        "verifier_idle_fraction": delta["wait_s"] / stats.decode_s if stats.decode_s else None,
        "mean_tree_nodes": delta["tree_nodes"] / delta["spec_rounds"] if delta["spec_rounds"] else None,
        "off_spine_rate": delta["off_spine"] / delta["spec_rounds"] if delta["spec_rounds"] else None,
        "lookup_tokens_per_round": delta["lookup_tokens"] / delta["spec_rounds"] if delta["spec_rounds"] else None,
        "bundle_wait_rate": delta["bundle_waited"] / delta["rounds"] if delta["rounds"] else None,
        # the drafter's fan-out actually built: below the budget where it fitted bundles to the verifier's step
        "branches_per_bundle": delta["branches"] / delta["bundles"] if delta["bundles"] else None,
        # steps on both cores, every request plain (verifier_service.core_lending)
        "lent_steps": delta["lent"],
        # run-ahead: speculating steps on both cores (the drafter idle), and rounds in the alternating schedule
        "idle_lent_steps": delta["idle_lent"],
        "alternating_round_fraction": (delta["alternating"] / delta["timed_rounds"]
                                       if delta["timed_rounds"] and local.strategy == "run-ahead" else None),
        "strategy": local.strategy,
        # run-ahead: the share of the request's time (prefill and decode) the drafter spent in its forwards
        "drafter_busy_fraction": (delta["drafter_busy"] / (stats.prefill_s + stats.decode_s)
                                  if stats.decode_s and local.strategy == "run-ahead" else None),
    }
    return seq, stats, ssd


def _snapshot(local: LocalSSD) -> dict[str, float]:
    s = local.proposer.stats
    schedule = getattr(local.proposer, "schedule", None)
    return {"hits": s.hits, "rounds": s.rounds, "wait_s": s.wait_s, "backup": s.backup, "tree_nodes": s.tree_nodes,
            "spec_rounds": sum(s.accepted_hist), "off_spine": s.off_spine_rounds, "bundle_waited": s.bundle_wait_rounds,
            "lookup_tokens": s.lookup_tokens,
            "bundles": s.bundles_received, "branches": s.branches_received,
            "lent": local.engine.lending.lent_steps if local.engine.lending is not None else 0,
            "idle_lent": local.engine.lending.idle_steps if local.engine.lending is not None else 0,
            "alternating": schedule.rounds[ALTERNATING] if schedule is not None else 0,
            "timed_rounds": sum(schedule.rounds.values()) if schedule is not None else 0,
            "drafter_busy": getattr(local.proposer, "drafter_busy_s", 0.0)}
