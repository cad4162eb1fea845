"""Continuous batching for the verifier: who runs this step, how many tokens, and preemption when blocks run out.

Every request follows one rule (as in vLLM's v1 scheduler): catch ``num_computed`` up to ``num_tokens - 1``, then
verify a speculation rooted at the last token. A step's work for a request is its pending tokens (prompt chunk or
the last token) plus, when it has caught up, its speculation nodes. There is no separate prefill phase, so prefill
and verification share one forward pass, bounded by a token budget.

Preemption is recompute-style: the newest running request gives back all its blocks and returns to the front of
the waiting queue with its generated tokens kept; it later re-prefills them. Outputs are unchanged by preemption.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from spec_core.block_manager import BlockManager, NoFreeBlocks
from spec_core.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_spec_nodes: int = 8

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be > 0")


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: ``num_pending`` tokens from ``num_computed``; speculate if caught up."""

    seq: Sequence
    num_pending: int
    speculate: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        need = self.blocks.blocks_for(seq.num_tokens + self.config.max_spec_nodes + 1)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request {seq.request_id} needs {need} KV blocks; the cache has {self.blocks.num_blocks}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or cancelled request and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.blocks.free(victim.request_id)
        victim.num_computed = 0
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        logger.info("preempted %s (recompute)", victim.request_id)

    def _reserve(self, seq: Sequence, total_tokens: int) -> bool:
        try:
            self.blocks.ensure(seq.request_id, total_tokens)
            return True
        except NoFreeBlocks:
            return False

    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's work. Every returned request has blocks for its pending tokens and speculation."""
        budget = self.config.max_num_batched_tokens
        spec = self.config.max_spec_nodes
        out: list[ScheduledSeq] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below by an earlier request
            pending = seq.num_tokens - seq.num_computed
            while not self._reserve(seq, seq.num_tokens + spec):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                take = min(pending, budget)
                if take <= 0:
                    break
                out.append(ScheduledSeq(seq, take, speculate=take == pending))
                budget -= take + (spec if take == pending else 0)
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self._reserve(seq, seq.num_tokens + spec):
                break
            self.waiting.popleft()
            self.running.append(seq)
            pending = seq.num_tokens - seq.num_computed
            take = min(pending, budget)
            out.append(ScheduledSeq(seq, take, speculate=take == pending))
            budget -= take + (spec if take == pending else 0)
        return out
