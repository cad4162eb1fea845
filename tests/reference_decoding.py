"""Test references: single-request AR and SD on the runner's contiguous cache, independent of the paged engine.

The product runs every mode through :class:`verifier_service.engine.VerifierEngine`; these loops stay only so the
tests can check the engine against a second, simpler implementation (and :func:`spec_core.rejection.verify`).

Timing and round definitions: :mod:`spec_core.metrics`.
"""

from __future__ import annotations

import time

import torch

from spec_core.config import SamplingParams
from spec_core.metrics import DecodeStats
from spec_core.rejection import verify
from spec_core.runner import KVCache, ModelRunner
from spec_core.sampling import request_probs, sample_from_probs
from spec_core.sequence import Sequence


def probs_for(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """The request's sampling distribution for ``logits [1, T, V]``."""
    return request_probs(logits, [seq.params])


def sample_next(seq: Sequence, logits: torch.Tensor) -> int:
    """Sample one token from the last row of ``logits [1, T, V]``."""
    if seq.params.greedy:
        return int(logits[0, -1].argmax())
    probs = probs_for(seq, logits[:, -1:])[0]
    return int(sample_from_probs(probs, seq.uniforms(1))[0])


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def _prefill(runner: ModelRunner, cache: KVCache, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    return runner.forward(
        cache, torch.tensor([ids]), torch.arange(n)[None], logits_index=torch.tensor([[n - 1]])
    )


def generate_ar(target: ModelRunner, seq: Sequence) -> DecodeStats:
    """Plain autoregressive decoding: one target forward per token."""
    stats = DecodeStats()
    cache = target.new_cache(1, seq.max_len)
    t = Timer()
    logits = _prefill(target, cache, seq.prompt_ids)
    seq.append([sample_next(seq, logits)])
    stats.prefill_s = t.elapsed()
    t = Timer()
    while not seq.finished:
        pos = seq.num_tokens - 1
        tv = time.perf_counter()
        logits = target.forward(cache, torch.tensor([[seq.token_ids[-1]]]), torch.tensor([[pos]]))
        stats.verify_s += time.perf_counter() - tv
        stats.record_round(0, 0, len(seq.append([sample_next(seq, logits)])))
    stats.decode_s = t.elapsed()
    stats.num_generated = len(seq.output_ids)
    return stats


class DraftState:
    """The draft's KV cache for one request, position-addressed: slots ``[0, num_cached)`` are valid."""

    def __init__(self, draft: ModelRunner, max_len: int) -> None:
        self.runner = draft
        self.cache = draft.new_cache(1, max_len)
        self.num_cached = 0

    def prefill(self, prompt_ids: list[int]) -> None:
        _prefill(self.runner, self.cache, prompt_ids)
        self.num_cached = len(prompt_ids)

    def propose(self, seq: Sequence, k: int) -> tuple[list[int], torch.Tensor]:
        """Draft ``k`` tokens after ``seq``; returns them and the ``[k, V]`` distributions they were drawn from."""
        ids = seq.token_ids
        if k == 0:
            return [], torch.zeros(0, self.runner.vocab_size)
        chunk, start = ids[self.num_cached :], self.num_cached
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self.runner.forward(
                self.cache,
                torch.tensor([chunk]),
                torch.arange(start, start + len(chunk))[None],
                logits_index=torch.tensor([[len(chunk) - 1]]),
            )
            probs = probs_for(seq, logits)[0, 0]
            tok = int(probs.argmax()) if seq.params.greedy else int(sample_from_probs(probs[None], seq.uniforms(1))[0])
            tokens.append(tok)
            rows.append(probs)
            start += len(chunk)
            chunk = [tok]
        # Valid draft KV now covers the old sequence plus every drafted token but the last.
        self.num_cached = len(ids) + k - 1
        return tokens, torch.stack(rows)

    def rollback(self, num_valid: int) -> None:
        self.num_cached = min(self.num_cached, num_valid)


def greedy_outputs(target: ModelRunner, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """The target's own greedy continuations of ``n_new`` tokens for each prompt (the exactness reference)."""
    out = []
    for p in prompts:
        seq = Sequence("ref", p, SamplingParams(max_new_tokens=n_new, ignore_eos=True))
        generate_ar(target, seq)
        out.append(seq.output_ids)
    return out


def generate_sd(target: ModelRunner, draft: ModelRunner, seq: Sequence, k: int) -> DecodeStats:
    """Synchronous speculative decoding: draft ``k`` tokens, verify them in one target forward, repeat."""
    stats = DecodeStats()
    max_len = min(seq.max_len, target.spec.max_positions, draft.spec.max_positions)
    cache = target.new_cache(1, max_len)
    dstate = DraftState(draft, max_len)
    t = Timer()
    logits = _prefill(target, cache, seq.prompt_ids)
    dstate.prefill(seq.prompt_ids)
    seq.append([sample_next(seq, logits)])
    stats.prefill_s = t.elapsed()
    t = Timer()
    while not seq.finished:
        n = seq.num_tokens
        k_round = max(0, min(k, seq.remaining - 1, max_len - n))
        td = time.perf_counter()
        draft_ids, draft_probs = dstate.propose(seq, k_round)
        stats.draft_s += time.perf_counter() - td
        chunk = [seq.token_ids[-1]] + draft_ids
        tv = time.perf_counter()
        logits = target.forward(cache, torch.tensor([chunk]), torch.arange(n - 1, n + k_round)[None])
        stats.verify_s += time.perf_counter() - tv
        out = verify(
            probs_for(seq, logits) if not seq.params.greedy else logits,
            draft_probs[None],
            torch.tensor([draft_ids], dtype=torch.int64).view(1, k_round),
            torch.tensor([k_round]),
            torch.tensor([seq.params.greedy]),
            seq.uniforms(k_round)[None] if not seq.params.greedy else torch.zeros(1, k_round),
            seq.uniforms(1) if not seq.params.greedy else torch.zeros(1),
        )
        num_acc = int(out.num_accepted[0])
        stats.record_round(k_round, num_acc, len(seq.append(out.parse()[0])))
        dstate.rollback(n + num_acc)
    stats.decode_s = t.elapsed()
    stats.num_generated = len(seq.output_ids)
    return stats
