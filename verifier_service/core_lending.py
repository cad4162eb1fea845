"""Lending the drafter's core to the verifier while nothing speculates (SSD on a CPU, both processes pinned on one node).

SSD holds two cores: the verifier's and the drafter's. Where speculation does not pay, the planner decodes the whole
batch plain (K = 0 for every request: the measured back-off, as for sampled requests at batch 16 on a CPU), the
drafter has nothing to draft, and SSD ran as AR on one core while its second idled (`ar-2t`, AR on both cores, is
1.50x `ar` at batch 16 in bf16 at T = 0.8). So once ``after`` steps in a row were plain (time for the drafter to
finish the bundles of the last speculating step), each further plain step runs the verifier's forward and
verification on both cores: CPU affinity over both and torch on two threads, handed back at the end of the step.
A step that speculates borrows the core only where a run-ahead drafter says it has nothing to draft (the
alternating schedule, :mod:`verifier_service.run_ahead_schedule`). While a plain step is lent the proposer also holds
back the prompts of new requests the planner starts plain (:meth:`verifier_service.ssd_proposer.SSDProposer.propose`,
``quiet``), so nothing wakes the drafter; such a request tells the drafter its tokens when it first speculates.

It lends only where both processes are pinned to cores of one node, so the drafter's core is known and free: the
local SSD (:class:`cluster.local_ssd.LocalSSD`), and the served pair when its two Ray actors share a node
(:class:`cluster.actors.VerifierActor`); and only on a CPU. Never for the fp32 exactness reference: its matmuls round differently on two
threads (SmolLM2-135M decode logits moved by up to 4e-5), and its greedy output must stay transformers' token for
token. The compiled matmuls split a call over its outputs, so their runners (int4, w8a8) give the same floats on
two threads (tests/test_cpu_kernels.py); bf16's oneDNN matmuls do not, and bf16 reports its agreement with fp32.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CoreLending:
    """The streak of plain steps and the lent ones (``lent_steps``, a counter for reports)."""

    verifier_core: int
    drafter_core: int
    #: Plain steps in a row before the next plain one borrows the drafter's core.
    after: int = 4
    streak: int = 0
    lent_steps: int = 0
    #: Speculating steps run on both cores because the run-ahead drafter had nothing to draft (counted by the
    #: engine, :mod:`spec_core.core_flags`).
    idle_steps: int = 0
    #: The OS refused the two cores once (:meth:`lent`): no step is lent after that.
    refused: bool = False

    def plan(self, plain: bool) -> bool:
        """Count a step (``plain``: every request at K = 0); whether it runs on both cores."""
        self.streak = self.streak + 1 if plain else 0
        lent = self.streak > self.after and not self.refused
        self.lent_steps += int(lent)
        return lent

    @contextlib.contextmanager
    def lent(self) -> Iterator[None]:
        """This thread on both cores, torch on two threads; both put back after. Where the OS refuses the cores,
        nothing changes and lending stops (logged once)."""
        affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
        try:
            os.sched_setaffinity(0, {self.verifier_core, self.drafter_core})
        except OSError as exc:
            logger.warning("cannot run on cores %d and %d (%s): plain steps stay on one core", self.verifier_core,
                           self.drafter_core, exc)
            self.refused = True
            yield
            return
        torch.set_num_threads(2)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            os.sched_setaffinity(0, affinity)


def core_lending(verifier_core: int | None, drafter_affinity: list[int], target) -> CoreLending | None:
    """A :class:`CoreLending` where it applies: a CPU target off the fp32 reference (module docstring), and a
    drafter process that runs pinned to one core of its own (``drafter_affinity``, as its ack reported it)."""
    if target.device.type != "cpu" or target.exact or not hasattr(os, "sched_setaffinity"):
        return None
    if verifier_core is None or len(drafter_affinity) != 1 or drafter_affinity[0] == verifier_core:
        return None
    return CoreLending(verifier_core, drafter_affinity[0])
