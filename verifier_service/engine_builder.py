"""The one place a :class:`~verifier_service.engine.VerifierEngine` is built: ``ssd serve``'s verifier, the local
two-process SSD, ``ssd generate``, offline batches and the bench all describe what they want as an
:class:`EnginePlan` and call :func:`build_engine`. Features (the K planner, core lending) are composed here, at
construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec_core.config import SAMPLING_RULES
from verifier_service.engine import EngineConfig, VerifierEngine
from verifier_service.scheduler import SchedulerConfig


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """What a verifier engine is made of, besides its target and proposer."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 1
    #: Tokens per forward.
    max_num_batched_tokens: int = 2048
    #: Draft tokens per round (0: plain decoding, whatever the proposer).
    k: int = 0
    #: Speculation nodes reserved per request and round (None: K).
    max_spec_nodes: int | None = None
    #: How sampled requests draw (``EngineConfig.sampling``).
    sampling: str = "auto"
    #: K per request and step from measured costs, down to 0 (:class:`verifier_service.adaptive.AdaptiveK`).
    #: A run-ahead proposer keeps K fixed: the planner's costs model a fan-out drafter.
    adaptive_k: bool = False

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1 or self.max_num_seqs < 1 or self.k < 0:
            raise ValueError(f"an engine needs blocks, a block size and a batch of at least 1, and K >= 0: {self}")
        if self.sampling not in SAMPLING_RULES:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLING_RULES)}, got {self.sampling!r}")

    def scheduler(self) -> SchedulerConfig:
        nodes = self.max_spec_nodes if self.max_spec_nodes is not None else self.k
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max(1, nodes))


def build_engine(target, plan: EnginePlan, proposer=None, lending=None) -> VerifierEngine:
    """The engine for ``target`` (a :class:`~spec_core.runner.ModelRunner`): ``proposer`` drafts its speculations
    (None: AR), ``lending`` (a :class:`~verifier_service.core_lending.CoreLending`) runs its plain steps on the
    drafter's core too."""
    from verifier_service.run_ahead_proposer import RunAheadProposer

    config = EngineConfig(plan.num_blocks, plan.block_size, plan.scheduler(), sampling=plan.sampling)
    k = plan.k if proposer is not None else 0
    adaptive = None
    if plan.adaptive_k and k > 0 and not isinstance(proposer, RunAheadProposer):
        from verifier_service.adaptive import AdaptiveK

        adaptive = AdaptiveK(k_max=k)
    return VerifierEngine(target, config, drafter=proposer, k=k, adaptive=adaptive, lending=lending)


def blocks_for_one(runner, k: int, block_size: int = 16) -> int:
    """KV blocks for one request of ``runner``'s full context plus a ``k``-token speculation."""
    return -(-(runner.spec.max_positions + k + 1) // block_size) + 1


def plan_for_one(target, k: int, block_size: int = 16, adaptive_k: bool = False) -> EnginePlan:
    """A batch-1 engine whose KV pool holds one request of the model's full context (and its speculation)."""
    tokens = target.spec.max_positions + k + 1
    return EnginePlan(blocks_for_one(target, k, block_size), block_size, max_num_seqs=1,
                      max_num_batched_tokens=max(2048, tokens), k=k, adaptive_k=adaptive_k)
