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

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from spec_core.backends import Backend
from spec_core.backends.default import as_backend
from spec_core.block_manager import BlockManager
from spec_core.config import SAMPLING_RULES
from spec_core.metrics import DecodeStats
from spec_core.packing import WorkItem, forward_items, reconcile_tree_slots
from spec_core.select import argmax_rows
from spec_core.sequence import Sequence
from spec_core.transfer import Crossings, HostCopy, crossings, to_device, to_host
from spec_core.tree import TokenTree, greedy_match_verify_tree_path, greedy_verify_tree_path
from verifier_service.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from verifier_service.target_rows import SampledRows, coupled_rows, sampled_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_blocks: int = 1024
    block_size: int = 16
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    #: A forward's fixed cost in tokens, for splitting a step into groups of similar length (None: by device;
    #: see :func:`spec_core.packing.split_by_length`). A prompt chunk joining short verifications runs apart.
    group_overhead_tokens: int | None = None
    #: How sampled requests draw: ``residual`` (speculative sampling's accept-or-resample with q rows), ``coupled``
    #: (:mod:`spec_core.coupling`: each token an exact race that depends only on the seed and the position,
    #: verified by argmax match), or ``auto``: coupled for seeded requests, which it keeps reproducible at any K,
    #: with the n-gram backup and without waiting for neural drafts (the residual rule's price for that was a fixed
    #: K and those waits), and residual for the rest, measured faster on a CPU where speculation barely pays.
    #: All are exact. A request whose params say (``SamplingParams.coupled`` not None) keeps its rule.
    sampling: str = "auto"

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLING_RULES:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLING_RULES)}, got {self.sampling!r}")


@dataclass(slots=True)
class EngineMetrics:
    """Engine-wide counters; per-request ones live in ``stats`` of each request."""

    num_steps: int = 0
    forward_s: float = 0.0
    step_s: float = 0.0
    draft_s: float = 0.0
    tokens_emitted: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    #: host↔device crossings of the verifier's own work (see :meth:`VerifierEngine.step`), total and last step
    crossings: int = 0
    last_step_crossings: int = 0
    #: ... of which downloads (each a synchronisation on a GPU).
    last_step_downloads: int = 0
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
            "crossings_per_step": self.crossings / self.num_steps if self.num_steps else None,
            "mean_batch_size": sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else None,
            "peak_kv_usage": max(self.kv_usage, default=0.0),
            "mean_tokens_per_round": s.mean_tokens_per_round,
            "acceptance_rate": s.acceptance_rate,
            "acceptance_by_position": s.acceptance_by_position(),
            "num_rounds": s.num_rounds,
        }


Proposer = Callable[[list[Sequence], list[int]], list[TokenTree]]


class VerifierEngine:
    """Continuous-batching verifier over a paged KV cache. ``drafter`` is None for plain AR decoding."""

    def __init__(self, target: Backend, config: EngineConfig, drafter=None, k: int = 0, adaptive=None,
                 lending=None) -> None:
        """Built by :func:`verifier_service.engine_builder.build_engine` (outside tests). ``target``: a
        :class:`~spec_core.backends.Backend`, or a runner (then its default one,
        :func:`~spec_core.backends.default.as_backend`); the engine touches the model through that protocol only."""
        self.backend = as_backend(target)
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.cache = self.backend.new_paged_cache(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        self.drafter = drafter
        if drafter is not None and getattr(drafter, "max_nodes", 0) is None:
            drafter.max_nodes = config.scheduler.max_spec_nodes  # the slots reserved per round bound a tree's size
        self.k = k if drafter is not None else 0
        #: Optional :class:`verifier_service.adaptive.AdaptiveK`: K per request and step from measured costs.
        self.adaptive = adaptive
        #: Optional :class:`verifier_service.core_lending.CoreLending`: plain steps on the drafter's core too.
        self.lending = lending
        self.metrics = EngineMetrics()

    # ---- request lifecycle ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        limit = self.backend.max_positions
        if seq.num_tokens >= limit:
            raise ValueError(f"request {seq.request_id}: {seq.num_tokens} tokens; the context limit is {limit}")
        seq.max_len = min(seq.max_len, limit)
        if seq.params.coupled is None:
            rule = self.config.sampling
            coupled = rule == "coupled" or (rule == "auto" and seq.params.seed is not None)
            seq.params = replace(seq.params, coupled=coupled)  # False when greedy (SamplingParams)
        seq.stats = DecodeStats()
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
        k = self.k if seq.planned_k is None or seq.reproducible else seq.planned_k
        return max(0, min(k, seq.remaining - 1, self.backend.max_positions - seq.num_tokens - 1))

    def _plan_k(self, seqs: list[Sequence]) -> None:
        if self.adaptive is None:
            return
        if self.lending is not None:
            self.adaptive.lend_after = self.lending.after
        plan = self.adaptive.plan({s.request_id: (s.stats.num_accepted, s.stats.num_drafted, s.stats.num_rounds)
                                   for s in seqs})
        for s in seqs:
            s.planned_k = plan[s.request_id]

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

    def _verify(self, seq: Sequence, argmax: list[int], tree: TokenTree, sampled: SampledRows
                ) -> tuple[list[int], list[int]]:
        """(emitted tokens: accepted path + one, accepted node indices) from the row argmaxes (on the host) of
        ``logits [N+1, V]``, or for a sampled request from its probabilities and plain draw in ``sampled``."""
        if seq.params.deterministic:  # greedy, or coupled (``argmax`` holds its race winners)
            return greedy_verify_tree_path(argmax, tree)
        if seq.request_id in sampled.picks:
            return [sampled.picks[seq.request_id]], []
        if seq.request_id in sampled.verified:  # a tree, verified on the device with the step's others
            return sampled.verified[seq.request_id]
        return greedy_match_verify_tree_path(sampled.probs[seq.request_id], tree, seq.uniforms(1))  # a control

    def _propose(self, work: list[ScheduledSeq]) -> tuple[dict[str, TokenTree], bool]:
        """Trees for the requests that have caught up (none in AR mode), timed on the requests they serve, and
        whether the step runs on the drafter's core too (:attr:`lending`)."""
        seqs = [w.seq for w in work if w.speculate]
        if self.drafter is None or not seqs:
            return {}, False
        self._plan_k(seqs)
        ks = [self._k_for(s) for s in seqs]
        lent = self.lending is not None and self.lending.plan(not any(ks))
        t_d = time.perf_counter()
        proposed = self.drafter.propose(seqs, ks, quiet=True) if lent else self.drafter.propose(seqs, ks)
        trees = dict(zip((s.request_id for s in seqs), proposed))
        draft_s = time.perf_counter() - t_d
        self.metrics.draft_s += draft_s
        for seq in seqs:  # a batched proposal's time counts for every request in it
            seq.stats.draft_s += draft_s
        return trees, lent

    def step(self) -> list[Sequence]:
        """Run one step; returns the requests that finished in it.

        Host↔device crossings of the verifier's own part (the proposer's are its own): one upload (the packed
        batch, per length group), one upload for tree K/V moves and, for sampled requests, their rows' settings
        and trees up; and one download (:class:`~spec_core.transfer.HostCopy`, :meth:`_decisions`). Logprobs add
        a download of their own."""
        t_step = time.perf_counter()
        work = self.scheduler.schedule()
        if not work:
            return []
        emitted_before = self.metrics.tokens_emitted
        trees, lent = self._propose(work)
        mark = replace(crossings())  # what crosses from here on is the verifier's own
        empty = TokenTree(parents=[], token_ids=[], draft_probs=None)
        chosen = [trees.get(w.seq.request_id, empty) if w.speculate else None for w in work]
        items = [self._item(w, tree) for w, tree in zip(work, chosen)]
        both = lent or self._drafter_idle(trees)
        with self.lending.lent() if both else contextlib.nullcontext(), self.backend.kernel_threads():
            finished = self._verify_step(work, items, chosen)
        self._account(work, items, t_step, mark, emitted_before, lent)
        return finished

    def _drafter_idle(self, trees: dict) -> bool:
        """Whether a speculating step runs on the drafter's core too: a run-ahead drafter process with nothing to
        draft says so (:mod:`spec_core.core_flags`), and every matmul is the compiled kernels', whose floats do not
        depend on the thread count (a seeded request's tokens must not depend on timing). Counted in
        :attr:`CoreLending.idle_steps`."""
        if self.lending is None or not trees or not self.backend.capabilities().batch_invariant:
            return False
        if not getattr(self.drafter, "drafter_idle", bool)():
            return False
        self.lending.idle_steps += 1
        return True

    def _verify_step(self, work: list[ScheduledSeq], items: list[WorkItem], chosen: list[TokenTree | None]
                     ) -> list[Sequence]:
        """The forward over ``items``, then each request's verification, K/V moves and finishing."""
        with self.backend.timer() as timer:  # CUDA events on a GPU: kernel time, not launch time
            logits = forward_items(self.backend, self.cache, items, self.config.group_overhead_tokens)
        argmax, sampled, coupled = self._decisions(logits, work, chosen)
        forward_s = timer.elapsed_s()
        self.metrics.forward_s += forward_s
        if self.drafter is not None:
            self.drafter.observe_verify_time(forward_s, sum(len(it.token_ids) for it in items))
        finished, moves = [], ([], [])
        for b, (w, tree) in enumerate(zip(work, chosen)):
            w.seq.stats.verify_s += forward_s
            if tree is None:
                w.seq.num_computed += w.num_pending
                continue
            picks = coupled.get(w.seq.request_id) or (argmax[b][: tree.num_nodes + 1] if argmax else [])
            self._apply(w.seq, tree, logits[b, : tree.num_nodes + 1], picks, moves, sampled)
            if w.seq.finished:
                finished.append(w.seq)
        self.cache.copy_slots(*moves)  # before any block is handed out again (next step's schedule)
        for seq in finished:
            self._finish(seq)
        return finished

    def _decisions(self, logits: torch.Tensor, work: list[ScheduledSeq], chosen: list[TokenTree | None]
                   ) -> tuple[list | None, SampledRows, dict[str, list[int]]]:
        """What the host needs to verify the step, in one download: every row's argmax where a greedy request reads
        it, the sampled requests' plain draws and trees' verification, and the coupled requests' race winners
        (:mod:`verifier_service.target_rows`)."""
        down = HostCopy()
        greedy = any(w.seq.params.deterministic and not w.seq.params.coupled for w in work)
        argmax_slot = down.add(argmax_rows(logits)) if greedy else None
        verifying = [(b, w.seq, tree) for b, (w, tree) in enumerate(zip(work, chosen)) if tree is not None]
        sampled = sampled_rows(logits, [r for r in verifying if not r[1].params.deterministic], down)
        coupled = coupled_rows(logits, [r for r in verifying if r[1].params.coupled], down)
        down.fetch()
        return down[argmax_slot] if argmax_slot is not None else None, sampled.resolve(down), coupled.resolve(down)

    def _account(self, work: list[ScheduledSeq], items: list[WorkItem], t_step: float, mark: Crossings,
                 emitted_before: int, lent: bool = False) -> None:
        """Metrics for a finished step, and its cost for the planner (``lent``: it ran on both cores)."""
        m = self.metrics
        m.num_steps += 1
        m.batch_sizes.append(len(work))
        m.kv_usage.append(self.blocks.usage)
        now = crossings()
        m.last_step_crossings = now.total - mark.total
        m.last_step_downloads = now.downloads - mark.downloads
        m.crossings += m.last_step_crossings
        step_s = time.perf_counter() - t_step
        m.step_s += step_s
        # The whole step: drafting, tree handling and rejection cost what K costs. Decode steps only: a prefill
        # chunk's tokens cost a fraction of a decode token's (matmuls over many rows), and fitting them made
        # speculation look nearly free at batch 16 for the ~50 steps the fit took to forget a prefill wave. A decode
        # request has one pending token (the last round's bonus).
        if self.adaptive is not None and all(w.num_pending <= 1 for w in work):
            self.adaptive.observe_step(sum(len(it.token_ids) for it in items), step_s,
                                       m.tokens_emitted - emitted_before, len(work),
                                       getattr(self.drafter, "cold_wait_s", 0.0), lent=lent)

    def _apply(self, seq: Sequence, tree: TokenTree, logits: torch.Tensor, argmax: list[int],
               moves: tuple[list[int], list[int]], sampled: SampledRows) -> None:
        """Verify, queue the K/V moves that put the accepted path in place, append, and tell the drafter."""
        emitted, path = self._verify(seq, argmax, tree, sampled)
        n = seq.num_tokens
        src, dst = reconcile_tree_slots(lambda a, b: self.blocks.slots(seq.request_id, a, b), n, path)
        moves[0].extend(src)
        moves[1].extend(dst)
        seq.num_computed = n + len(path)
        self.blocks.commit(seq.request_id, seq.num_computed)
        depth = max(tree.depths(), default=0)
        after_prefill = bool(seq.output_ids)  # the prefill forward's token is not a decode round
        chosen, top = (_emitted_logprobs(logits, path, emitted, seq.params.top_logprobs) if seq.params.logprobs
                       else (None, None))
        taken = seq.append(emitted, chosen, top)
        if after_prefill:
            seq.stats.record_round(depth, len(path), len(taken))
            self.metrics.stats.record_round(depth, len(path), len(taken))
        seq.stats.num_generated = len(seq.output_ids)
        self.metrics.tokens_emitted += len(taken)
        if self.drafter is not None:
            self.drafter.commit(seq, n, tree, path, self._k_for(seq))

    def run(self, on_finish: Callable[[Sequence], None] | None = None) -> None:
        """Step until every request is done."""
        while self.has_work():
            for seq in self.step():
                if on_finish is not None:
                    on_finish(seq)


def _emitted_logprobs(logits: torch.Tensor, path: list[int], emitted: list[int],
                      num_top: int = 0) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """The target's log-probability of each emitted token, and with ``num_top`` its most likely alternatives
    (best first). Token j is predicted by the row of its parent (row 0 is the root, row i + 1 is tree node i)."""
    rows = [0] + [i + 1 for i in path]
    picks = to_device([rows[: len(emitted)], emitted], logits.device, torch.long)
    logp = torch.log_softmax(logits[picks[0]].float(), dim=-1)
    chosen = logp.gather(-1, picks[1][:, None])
    if not num_top:
        return to_host(chosen[:, 0]), None
    vals, ids = logp.topk(num_top, dim=-1)
    packed = to_host(torch.cat([chosen, vals, ids.to(vals.dtype)], dim=1))  # one download
    top = [list(zip((int(t) for t in row[1 + num_top:]), row[1:1 + num_top])) for row in packed]
    return [row[0] for row in packed], top
