"""``ssd batch``: offline generation over a JSONL file through the continuous-batching engine.

Input lines: ``{"prompt": str | "prompt_token_ids": [int], "id"?, "max_new_tokens"?, "temperature"?, "top_p"?,
"top_k"?, "seed"?, "stop"?, "stop_token_ids"?, "ignore_eos"?}``. Output lines, in input order:
``{"id", "text", "token_ids", "num_generated", "finish_reason", "num_prompt_tokens", "num_rounds",
"mean_tokens_per_round"}``. The input format and its validation live in :mod:`verifier_service.batch_requests`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from spec_core import chat
from spec_core.config import SamplingParams
from spec_core.detokenizer import IncrementalDetokenizer
from spec_core.draft_engine import BatchDrafter, DraftConfig
from spec_core.models import LoadedPair
from spec_core.sequence import Sequence
from spec_core.settings import ServiceConfig
from verifier_service.batch_requests import BatchSettings
from verifier_service.engine import VerifierEngine
from verifier_service.engine_builder import EnginePlan, build_engine

logger = logging.getLogger(__name__)


def batch_engine(pair: LoadedPair, settings: BatchSettings) -> VerifierEngine:
    drafter = None
    if settings.mode == "sd":
        if pair.draft is None:
            raise ValueError("mode sd needs a draft model")
        drafter = BatchDrafter(pair.draft, DraftConfig(k=settings.k, branching=settings.branching,
                                                       num_blocks=settings.num_blocks, block_size=settings.block_size))
    plan = EnginePlan(settings.num_blocks, settings.block_size, settings.concurrency, k=settings.k,
                      max_spec_nodes=settings.k * settings.branching)
    return build_engine(pair.target, plan, drafter)


def make_sequences(pair: LoadedPair, rows: list[tuple[str, object, SamplingParams]]) -> list[Sequence]:
    """One sequence per request; ids must be unique (the engine keys its block tables by them)."""
    if len({rid for rid, _, _ in rows}) != len(rows):
        raise ValueError("request ids must be unique")
    seqs = []
    vocab = pair.target.vocab_size
    max_len = pair.target.spec.max_positions
    for rid, prompt, params in rows:
        ids = chat.encode(pair.tokenizer, prompt)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {rid}: prompt_token_ids out of vocabulary (size {vocab}): {bad[:3]}")
        seqs.append(Sequence(rid, list(ids), params, eos_ids=pair.eos_ids,
                             max_len=max_len, detokenizer=IncrementalDetokenizer(pair.tokenizer)))
    return seqs


def result_json(seq: Sequence, engine: VerifierEngine) -> dict:
    stats = seq.stats
    return {
        "id": seq.request_id,
        "text": seq.text,
        "token_ids": seq.output_ids,
        "num_generated": len(seq.output_ids),
        "finish_reason": seq.finish_reason,
        "num_prompt_tokens": len(seq.prompt_ids),
        "num_rounds": stats.num_rounds,
        "mean_tokens_per_round": stats.mean_tokens_per_round,
    }


def run_batch(pair: LoadedPair, requests: list, output_path: Path, settings: BatchSettings,
              config: ServiceConfig | None = None) -> dict:
    """Run ``requests`` (from :func:`verifier_service.batch_requests.read_requests`); write results in input order;
    return engine metrics. Mode ssd runs ``config``'s speculation settings (default: the one config's defaults)
    with the batch's K, concurrency and KV pool."""
    seqs = make_sequences(pair, requests)
    if settings.mode == "ssd":
        from cluster.local_ssd import LocalPlacement, LocalSSD

        base = (config or ServiceConfig()).model_copy(update={"k": settings.k, "max_num_seqs": settings.concurrency,
                                                               "draft": settings.draft_path})
        place = LocalPlacement(num_blocks=settings.num_blocks, block_size=settings.block_size,
                               drafter_blocks=settings.num_blocks)
        with LocalSSD(pair.target, base, place, eos_ids=pair.eos_ids) as local:
            summary = _run_engine(local.engine, seqs, output_path)
            summary["cache_hit_rate"] = local.proposer.stats.cache_hit_rate
            return summary
    return _run_engine(batch_engine(pair, settings), seqs, output_path)


def _run_engine(engine: VerifierEngine, seqs: list[Sequence], output_path: Path) -> dict:
    """Run every sequence to the end; a progress bar (one step per finished request) goes to stderr when it is
    a terminal, so stdout (JSON) and piped logs stay clean."""
    from tqdm import tqdm

    for seq in seqs:
        engine.add(seq)
    t0 = time.perf_counter()
    with tqdm(total=len(seqs), desc="batch", unit="req", disable=None) as bar:
        engine.run(on_finish=lambda _seq: bar.update(1))
    wall = time.perf_counter() - t0
    engine.blocks.check_all_free()
    with output_path.open("w", encoding="utf-8") as f:
        for seq in seqs:
            f.write(json.dumps(result_json(seq, engine)) + "\n")
    total = sum(len(s.output_ids) for s in seqs)
    return {"requests": len(seqs), "generated_tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "preemptions": engine.scheduler.num_preemptions, **engine.metrics.to_json()}
