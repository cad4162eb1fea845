"""The verifier engine: one target forward per step over a packed ragged batch, exact verification, KV reconciliation.

``step()``:
  1. the scheduler picks each request's pending tokens (prompt chunk or last token) within the token budget;
  2. requests that have caught up get a speculation tree from the proposer (none in AR mode);
  3. one ``forward_paged`` call runs every request's pending tokens and tree nodes (tree-shaped attention);
  4. each tree is verified (greedy or exact stochastic, per request) and emits accepted tokens + one more;
  5. the accepted path's K/V is compacted into place and blocks past the new committed length are freed;
  6. finished requests leave the batch and give back their blocks on both sides.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spec_core.block_manager import BlockManager
from spec_core.decoding import DecodeStats
from spec_core.packing import WorkItem, forward_items, reconcile_tree_slots
from spec_core.runner import ModelRunner
from spec_core.sampling import request_probs
from spec_core.sequence import Sequence
from spec_core.tree import (
    TokenTree,
    greedy_match_verify_tree_path,
    greedy_verify_tree_path,
    stochastic_verify_tree_path,
)
from verifier_service.scheduler import ScheduledSeq, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_blocks: int = 1024
    block_size: int = 16
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    #: Test hook: seconds added to every target forward (emulates a slower verifier).
    verify_delay_s: float = 0.0
    #: A forward's fixed cost in tokens, for splitting a step into groups of similar length (None: by device;
    #: see :func:`spec_core.packing.split_by_length`). A prompt chunk joining short verifications runs apart.
    group_overhead_tokens: int | None = None


@dataclass(slots=True)
class EngineMetrics:
    """Engine-wide counters; per-request ones live in ``stats`` of each request."""

    num_steps: int = 0
    forward_s: float = 0.0
    step_s: float = 0.0
    draft_s: float = 0.0
    tokens_emitted: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)

    def to_json(self) -> dict:
        s = self.stats
        return {
            "num_steps": self.num_steps,
            "forward_s": self.forward_s,
            "step_s": self.step_s,
            "outside_forward_fraction": 1 - self.forward_s / self.step_s if self.step_s else None,
            "draft_s": self.draft_s,
            "mean_batch_size": sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else None,
            "peak_kv_usage": max(self.kv_usage, default=0.0),
            "mean_tokens_per_round": s.num_accepted / s.num_rounds + 1 if s.num_rounds else None,
            "acceptance_rate": s.acceptance_rate,
            "acceptance_by_position": s.acceptance_by_position(),
            "num_rounds": s.num_rounds,
        }


Proposer = Callable[[list[Sequence], list[int]], list[TokenTree]]


class VerifierEngine:
    """Continuous-batching verifier over a paged KV cache. ``drafter`` is None for plain AR decoding."""

    def __init__(self, runner: ModelRunner, config: EngineConfig, drafter=None, k: int = 0) -> None:
        self.runner = runner
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.cache = runner.new_paged_cache(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        self.drafter = drafter
        self.k = k if drafter is not None else 0
        #: Optional :class:`verifier_service.adaptive.AdaptiveK`: K per request and step from measured costs.
        self.adaptive = None
        self._planned_k: dict[str, int] = {}
        self.metrics = EngineMetrics()
        self.req_stats: dict[str, DecodeStats] = {}

    # ---- request lifecycle ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        limit = self.runner.spec.max_positions
        if seq.num_tokens >= limit:
            raise ValueError(f"request {seq.request_id}: {seq.num_tokens} tokens; the context limit is {limit}")
        seq.max_len = min(seq.max_len, limit)
        self.req_stats[seq.request_id] = DecodeStats()
        self.scheduler.add(seq)

    def cancel(self, seq: Sequence) -> None:
        seq.finish_reason = seq.finish_reason or "cancelled"
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        if self.drafter is not None:
            self.drafter.release(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ------------------------------------------------------------------------------------------
    def _k_for(self, seq: Sequence) -> int:
        k = self._planned_k.get(seq.request_id, self.k)
        return max(0, min(k, seq.remaining - 1, self.runner.spec.max_positions - seq.num_tokens - 1))

    def _plan_k(self, seqs: list[Sequence]) -> None:
        if self.adaptive is None:
            return
        stats = self.req_stats
        self._planned_k = self.adaptive.plan({
            s.request_id: (stats[s.request_id].num_accepted, stats[s.request_id].num_drafted,
                           stats[s.request_id].num_rounds) for s in seqs})

    def _item(self, work: ScheduledSeq, tree: TokenTree | None) -> WorkItem:
        seq, c = work.seq, work.seq.num_computed
        end = c + work.num_pending
        slots = lambda a, b: self.blocks.slots(seq.request_id, a, b)  # noqa: E731
        tokens = seq.token_ids[c:end]
        if tree is None:
            return WorkItem(slots(0, c), tokens, list(range(c, end)), slots(c, end), len(tokens), [], [])
        n = seq.num_tokens
        depths = tree.depths()
        return WorkItem(
            prefix_slots=slots(0, c),
            token_ids=tokens + tree.token_ids,
            positions=list(range(c, n)) + [n - 1 + d for d in depths],
            write_slots=slots(c, n) + slots(n, n + tree.num_nodes),
            num_pending=len(tokens),
            parents=tree.parents,
            logits_rows=[len(tokens) - 1 + i for i in range(tree.num_nodes + 1)],
        )

    def _verify(self, seq: Sequence, logits: torch.Tensor, tree: TokenTree) -> tuple[list[int], list[int]]:
        """``logits [N+1, V]`` → (emitted tokens: accepted path + one, accepted node indices)."""
        if seq.params.greedy:
            return greedy_verify_tree_path(logits, tree)
        probs = request_probs(logits[None], [seq.params])[0]
        if tree.greedy_match:
            return greedy_match_verify_tree_path(probs, tree, seq.uniforms(1))
        return stochastic_verify_tree_path(probs, tree, seq.uniforms(tree.num_nodes + 1))

    def step(self) -> list[Sequence]:
        """Run one step; returns the requests that finished in it."""
        t_step = time.perf_counter()
        work = self.scheduler.schedule()
        if not work:
            return []
        spec_work = [w for w in work if w.speculate]
        trees: dict[str, TokenTree] = {}
        if self.drafter is not None and spec_work:
            seqs = [w.seq for w in spec_work]
            self._plan_k(seqs)
            t_d = time.perf_counter()
            for seq, tree in zip(seqs, self.drafter.propose(seqs, [self._k_for(s) for s in seqs])):
                trees[seq.request_id] = tree
            self.metrics.draft_s += time.perf_counter() - t_d
        empty = TokenTree(parents=[], token_ids=[], draft_probs=None)
        items = [self._item(w, trees.get(w.seq.request_id, empty) if w.speculate else None) for w in work]
        t_f = time.perf_counter()
        logits = forward_items(self.runner, self.cache, items, self.config.group_overhead_tokens)
        if self.config.verify_delay_s:
            time.sleep(self.config.verify_delay_s)
        forward_s = time.perf_counter() - t_f
        self.metrics.forward_s += forward_s
        if self.drafter is not None:
            self.drafter.observe_verify_time(forward_s)
        finished = []
        for b, w in enumerate(work):
            if not w.speculate:
                w.seq.num_computed += w.num_pending
                continue
            tree = trees.get(w.seq.request_id, empty)
            self._apply(w.seq, tree, logits[b, : tree.num_nodes + 1])
            if w.seq.finished:
                self._finish(w.seq)
                finished.append(w.seq)
        m = self.metrics
        m.num_steps += 1
        m.batch_sizes.append(len(work))
        m.kv_usage.append(self.blocks.usage)
        step_s = time.perf_counter() - t_step
        m.step_s += step_s
        if self.adaptive is not None:  # the whole step: drafting, tree handling and rejection cost what K costs
            self.adaptive.cost.observe(sum(len(it.token_ids) for it in items), step_s)
        return finished

    def _apply(self, seq: Sequence, tree: TokenTree, logits: torch.Tensor) -> None:
        """Verify, reconcile the target's K/V with the accepted path, append, and tell the drafter."""
        emitted, path = self._verify(seq, logits, tree)
        n = seq.num_tokens
        src, dst = reconcile_tree_slots(lambda a, b: self.blocks.slots(seq.request_id, a, b), n, path)
        self.cache.copy_slots(src, dst)
        seq.num_computed = n + len(path)
        self.blocks.commit(seq.request_id, seq.num_computed)
        depth = max(tree.depths(), default=0)
        stats = self.req_stats[seq.request_id]
        after_prefill = bool(seq.output_ids)  # the prefill forward's token is not a decode round
        taken = seq.append(emitted, _emitted_logprobs(logits, path, emitted) if seq.params.logprobs else None)
        if after_prefill:
            stats.record_round(depth, len(path))
            self.metrics.stats.record_round(depth, len(path))
        stats.num_generated = len(seq.output_ids)
        self.metrics.tokens_emitted += len(taken)
        if self.drafter is not None:
            self.drafter.commit(seq, n, tree, path, self._k_for(seq))

    def run(self, on_finish: Callable[[Sequence], None] | None = None) -> None:
        """Step until every request is done."""
        while self.has_work():
            for seq in self.step():
                if on_finish is not None:
                    on_finish(seq)


def _emitted_logprobs(logits: torch.Tensor, path: list[int], emitted: list[int]) -> list[float]:
    """The target's log-probability of each emitted token: token j is predicted by the row of its parent
    (row 0 is the root, row i + 1 is tree node i)."""
    rows = [0] + [i + 1 for i in path]
    logp = torch.log_softmax(logits[rows[: len(emitted)]].float(), dim=-1)
    return logp[torch.arange(len(emitted)), torch.tensor(emitted)].tolist()
