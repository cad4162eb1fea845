"""Verifier throughput at several batch sizes, with chain and tree speculations (``ssd bench-verifier``).

The verifier's share of a step is the step minus the drafter's proposal time (the drafter has its own device in
SSD). ``outside_forward_fraction`` = 1 − forward time ÷ verifier step time: packing, masks, KV gather/scatter
bookkeeping, verification, sampling and scheduling all count as outside the runner's forward call.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from cluster.offline_batch import batch_engine
from spec_core import chat
from spec_core.config import ModelConfig, SamplingParams
from spec_core.models import load_pair, set_threads
from spec_core.prompts import humaneval_prompts
from spec_core.sequence import Sequence
from verifier_service.batch_requests import BatchSettings

logger = logging.getLogger(__name__)

SHAPES = {"chain": (5, 1), "tree": (3, 3)}


@dataclass(frozen=True, slots=True)
class VerifierBenchSettings:
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    shapes: tuple[str, ...] = ("chain", "tree")
    max_new_tokens: int = 64
    threads: int = 1


def run_one(pair, prompts: list[list[int]], batch: int, shape: str, max_new: int) -> dict:
    k, branching = SHAPES[shape]
    engine = batch_engine(pair, BatchSettings(mode="sd", concurrency=batch, k=k, branching=branching))
    for i, ids in enumerate(prompts[:batch]):
        engine.add(Sequence(str(i), ids, SamplingParams(max_new_tokens=max_new, ignore_eos=True)))
    # warm-up step (first prefill) excluded from the timing window
    engine.step()
    m = engine.metrics
    base = (m.forward_s, m.step_s, m.draft_s, m.tokens_emitted)
    engine.run()
    forward = m.forward_s - base[0]
    verifier_step = (m.step_s - base[1]) - (m.draft_s - base[2])
    tokens = m.tokens_emitted - base[3]
    return {
        "batch": batch,
        "speculation": shape,
        "k": k,
        "branching": branching,
        "verifier_tokens_per_s": tokens / verifier_step,
        "outside_forward_fraction": 1 - forward / verifier_step,
        "mean_tokens_per_round": m.stats.mean_tokens_per_round,
        "mean_batch_size": sum(m.batch_sizes) / len(m.batch_sizes),
    }


def run_verifier_bench(settings: VerifierBenchSettings, target: ModelConfig, draft: ModelConfig) -> dict:
    set_threads(settings.threads)
    pair = load_pair(target, draft)
    limit = pair.target.spec.max_positions - settings.max_new_tokens - 1
    prompts = [chat.encode_prompt(pair.tokenizer, p)[-limit:]
               for p in humaneval_prompts(max(settings.batch_sizes))]
    rows = []
    for shape in settings.shapes:
        for batch in settings.batch_sizes:
            rows.append(run_one(pair, prompts, batch, shape, settings.max_new_tokens))
            r = rows[-1]
            sys.stdout.write(f"{shape:<6} batch {batch:>3}: {r['verifier_tokens_per_s']:8.1f} verifier tok/s, "
                             f"outside forward {100 * r['outside_forward_fraction']:5.1f}%, "
                             f"{r['mean_tokens_per_round']:.2f} tok/round\n")
    return {"settings": {"threads": settings.threads, "max_new_tokens": settings.max_new_tokens}, "results": rows}
