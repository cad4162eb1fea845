"""Local two-process SSD: the verifier engine here (pinned to one core), the drafter in its own process (another).

The two exchange outcomes and speculations over a pipe (:class:`drafter_service.process.PipeLink`), the same
interface the gRPC transport implements, so the loop is tested and measured without Ray.

A dead drafter process (killed, crashed) is seen by the link at once: every round then runs on the backup, while a
watcher thread starts a new drafter process; the engine switches to it between steps, and every request in flight
re-prefills there, as a reconnected gRPC drafter does.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
from dataclasses import dataclass, field

import torch

from drafter_service.process import DrafterProcessConfig, spawn_drafter
from protos import codec
from spec_core.arch import decode_params
from spec_core.config import SSDConfig, draft_dtype
from spec_core.runner import ModelRunner
from spec_core.settings import ServiceConfig
from verifier_service.core_lending import core_lending
from verifier_service.engine import VerifierEngine
from verifier_service.engine_builder import EnginePlan, build_engine
from verifier_service.run_ahead_proposer import RunAheadProposer
from verifier_service.ssd_proposer import SSDProposer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LocalSSDConfig:
    draft_path: str
    ssd: SSDConfig = field(default_factory=SSDConfig)
    verifier_core: int | None = 0
    drafter_core: int | None = 1
    backup: str = "ngram"
    max_num_seqs: int = 8
    num_blocks: int = 2048
    block_size: int = 16
    tree_delay_s: float = 0.0
    verify_delay_s: float = 0.0
    wait_fraction: float = 0.5
    backup_policy: str = "auto"
    #: K per step and request from measured costs (down to 0); off: always ``ssd.k``.
    adaptive_k: bool = False
    #: the drafter process's dtype and device; ``None``: the target's (see ``LocalSSD._default_draft_dtype``)
    draft_dtype: str | None = None
    draft_device: str | None = None
    #: Row padding for the drafter's runner (:mod:`spec_core.backends.cpu.row_padding`).
    draft_pad_rows: bool = True
    #: The compiled small ops for the drafter's runner (:mod:`spec_core.backends.cpu.cpu_kernels`).
    draft_cpu_kernels: bool = True
    #: The draft head's vocabulary (``ModelConfig.head_vocab``; None: auto, :mod:`spec_core.draft_vocab`).
    draft_head_vocab: int | None = None
    #: How often the watcher checks the drafter process (and restarts it if it died); 0 = never restart.
    restart_interval_s: float = 0.5
    #: How sampled requests draw (``EngineConfig.sampling``: auto, residual or coupled).
    sampling: str = "auto"
    #: Plain steps borrow the drafter's core while nothing speculates (:mod:`verifier_service.core_lending`).
    lend_cores: bool = True

    @classmethod
    def from_config(cls, draft_path: str, config: ServiceConfig, drafter_pool: dict | None = None,
                    **process) -> LocalSSDConfig:
        """The local pair running the one configuration's speculation and engine settings, as ``ssd serve`` would
        (K, budget, C, tree, strategy, adaptive K, backup policy, sampling, batch size, the draft's dtype);
        ``drafter_pool``: the drafter's KV pool size; ``process``: this path's own fields (cores, the verifier's
        KV pool, the draft runner's options, lending)."""
        if config.draft_dtype is not None:
            process.setdefault("draft_dtype", config.draft_dtype)
        process.setdefault("lend_cores", config.lend_cores)
        return cls(draft_path, config.ssd_config(**(drafter_pool or {})), adaptive_k=config.adaptive_k,
                   backup_policy=config.backup_policy, sampling=config.sampling, max_num_seqs=config.max_num_seqs,
                   **process)


class LocalSSD:
    """Context manager owning the drafter process and an SSD-driven :class:`VerifierEngine`."""

    def __init__(self, target: ModelRunner, config: LocalSSDConfig, eos_ids: tuple[int, ...] = ()) -> None:
        self.target = target
        self.config = config
        self.eos_ids = eos_ids
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
        #: Set while a run-ahead verifier waits for its drafter, which then borrows its core (shared memory).
        self._waiting = mp.get_context("spawn").RawValue("b", 0)

    def _spawn(self) -> None:
        cfg, ssd = self.config, self.config.ssd
        hello = codec.make_hello("", self.target.vocab_size, ssd.k, ssd.fanout.budget,
                                 codec.sampling_mode(ssd.saguaro_c, ssd.fanout.kind, ssd.tree), cfg.backup, cfg.wait_fraction,
                                 target_params=decode_params(self.target.hf_config))
        lend = cfg.verifier_core if cfg.lend_cores and self.target.device.type == "cpu" else None
        self.proc, self.link, self.drafter_info = spawn_drafter(
            DrafterProcessConfig(cfg.draft_path, ssd, core=cfg.drafter_core, tree_delay_s=cfg.tree_delay_s,
                                 dtype=cfg.draft_dtype or self._default_draft_dtype(),
                                 device=cfg.draft_device or str(self.target.device), pad_rows=cfg.draft_pad_rows,
                                 cpu_kernels=cfg.draft_cpu_kernels, lend_core=lend,
                                 head_vocab=cfg.draft_head_vocab, cuda_graphs=self.target.cuda_graphs),
            hello, waiting=self._waiting,
        )

    def _default_draft_dtype(self) -> str:
        """The target's dtype, or for a weight-only target (int4, int8) the draft's own default (``draft_dtype``)."""
        return draft_dtype(self.target.weights or str(self.target.dtype).removeprefix("torch."),
                           self.target.kernels is not None, self.config.draft_path)

    def _watch(self) -> None:
        """Restart a dead drafter process; the proposer switches to the new link at its next step."""
        while not self._stopping.wait(self.config.restart_interval_s):
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
        cfg = self.config
        self._spawn()
        if cfg.verifier_core is not None and hasattr(os, "sched_setaffinity"):
            self._old_affinity = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {cfg.verifier_core})
        torch.set_num_threads(1)
        common = dict(backup=cfg.backup, wait_fraction=cfg.wait_fraction, backup_policy=cfg.backup_policy,
                      device=self.target.device, max_nodes=cfg.ssd.max_nodes)
        if self.strategy == "run-ahead":
            proposer = RunAheadProposer(self.link, self.target.vocab_size, waiting=self._waiting, **common)
        else:
            proposer = SSDProposer(self.link, self.target.vocab_size, **common)
        plan = EnginePlan(cfg.num_blocks, cfg.block_size, cfg.max_num_seqs, k=cfg.ssd.k, max_spec_nodes=cfg.ssd.max_nodes,
                          sampling=cfg.sampling, adaptive_k=cfg.adaptive_k, verify_delay_s=cfg.verify_delay_s)
        if cfg.adaptive_k and self.strategy == "run-ahead":
            logger.info("run-ahead drafting keeps K fixed at %d (the planner's costs model a fan-out drafter)", cfg.ssd.k)
        lending = (core_lending(cfg.verifier_core, self.drafter_info.get("affinity", []), self.target)
                   if cfg.lend_cores else None)
        self.engine = build_engine(self.target, plan, proposer, lending)
        if self.engine.lending is not None:
            with self.engine.lending.lent():
                self.target.row_padding()  # measured per thread count: now, not in the first lent step
        if cfg.restart_interval_s > 0:
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
        "strategy": local.strategy,
        # run-ahead: the share of the request's time (prefill and decode) the drafter spent in its forwards
        "drafter_busy_fraction": (delta["drafter_busy"] / (stats.prefill_s + stats.decode_s)
                                  if stats.decode_s and local.strategy == "run-ahead" else None),
    }
    return seq, stats, ssd


def _snapshot(local: LocalSSD) -> dict[str, float]:
    s = local.proposer.stats
    return {"hits": s.hits, "rounds": s.rounds, "wait_s": s.wait_s, "backup": s.backup, "tree_nodes": s.tree_nodes,
            "spec_rounds": sum(s.accepted_hist), "off_spine": s.off_spine_rounds, "bundle_waited": s.bundle_wait_rounds,
            "lookup_tokens": s.lookup_tokens,
            "bundles": s.bundles_received, "branches": s.branches_received,
            "lent": local.engine.lending.lent_steps if local.engine.lending is not None else 0,
            "drafter_busy": getattr(local.proposer, "drafter_busy_s", 0.0)}
