"""``ssd batch``: offline generation over a JSONL file through the continuous-batching engine.

Input lines: ``{"prompt": str | "prompt_token_ids": [int], "id"?, "max_new_tokens"?, "temperature"?, "top_p"?,
"top_k"?, "seed"?, "stop"?, "stop_token_ids"?, "ignore_eos"?}``. Output lines, in input order:
``{"id", "text", "token_ids", "num_generated", "finish_reason", "num_prompt_tokens", "num_rounds",
"mean_tokens_per_round"}``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from drafter_service.draft_engine import BatchDrafter, DraftConfig
from spec_core.config import SamplingParams
from spec_core.detokenizer import IncrementalDetokenizer
from spec_core.models import LoadedPair
from spec_core.sequence import Sequence
from verifier_service.engine import EngineConfig, VerifierEngine
from verifier_service.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)

_PARAM_KEYS = {"max_new_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int,
               "ignore_eos": bool}


@dataclass(frozen=True, slots=True)
class BatchSettings:
    mode: str = "sd"
    concurrency: int = 8
    k: int = 5
    branching: int = 1
    max_new_tokens: int = 128
    num_blocks: int = 2048
    block_size: int = 16
    #: The draft's folder: needed by ``ssd`` mode, whose drafter runs in its own process.
    draft_path: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("ar", "sd", "ssd"):
            raise ValueError(f"batch mode {self.mode!r} is not available; choose ar, sd or ssd")
        if self.mode == "ssd" and (self.draft_path is None or self.k < 1):
            raise ValueError("batch mode ssd needs a draft model and --k >= 1")
        if self.concurrency <= 0:
            raise ValueError(f"--concurrency must be > 0, got {self.concurrency}")


def parse_request(row: object, line_no: int, default_max_new: int) -> tuple[str | None, object, SamplingParams]:
    """Validate one input line → (id, prompt text or token ids, sampling params). Raises ValueError."""
    where = f"line {line_no}"
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    prompt, ids = row.get("prompt"), row.get("prompt_token_ids")
    if (prompt is None) == (ids is None):
        raise ValueError(f'{where}: give exactly one of "prompt" or "prompt_token_ids"')
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f'{where}: "prompt" must be a non-empty string')
    if ids is not None and (not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids)):
        raise ValueError(f'{where}: "prompt_token_ids" must be a non-empty list of integers')
    kwargs: dict = {"max_new_tokens": default_max_new}
    for key, typ in _PARAM_KEYS.items():
        if key in row and row[key] is not None:
            if typ is float and isinstance(row[key], (int, float)) and not isinstance(row[key], bool):
                kwargs[key] = float(row[key])
            elif isinstance(row[key], typ) and not (typ is int and isinstance(row[key], bool)):
                kwargs[key] = row[key]
            else:
                raise ValueError(f"{where}: {key} must be {typ.__name__}")
    if "stop" in row:
        stop = row["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f'{where}: "stop" must be a string or a list of non-empty strings')
        kwargs["stop"] = tuple(stop)
    if "stop_token_ids" in row:
        kwargs["stop_token_ids"] = tuple(int(i) for i in row["stop_token_ids"])
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    rid = row.get("id")
    return (str(rid) if rid is not None else None), (prompt if prompt is not None else ids), params


def build_engine(pair: LoadedPair, settings: BatchSettings) -> VerifierEngine:
    drafter = None
    if settings.mode == "sd":
        if pair.draft is None:
            raise ValueError("mode sd needs a draft model")
        drafter = BatchDrafter(pair.draft, DraftConfig(k=settings.k, branching=settings.branching,
                                                       num_blocks=settings.num_blocks, block_size=settings.block_size))
    sched = SchedulerConfig(max_num_seqs=settings.concurrency, max_spec_nodes=settings.k * settings.branching)
    config = EngineConfig(num_blocks=settings.num_blocks, block_size=settings.block_size, scheduler=sched)
    return VerifierEngine(pair.target, config, drafter=drafter, k=settings.k)


def make_sequences(pair: LoadedPair, rows: list[tuple[str | None, object, SamplingParams]]) -> list[Sequence]:
    seqs = []
    vocab = pair.target.vocab_size
    max_len = pair.target.spec.max_positions
    for i, (rid, prompt, params) in enumerate(rows):
        ids = pair.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else prompt
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {rid or i}: prompt_token_ids out of vocabulary (size {vocab}): {bad[:3]}")
        seqs.append(Sequence(rid if rid is not None else str(i), list(ids), params, eos_ids=pair.eos_ids,
                             max_len=max_len, detokenizer=IncrementalDetokenizer(pair.tokenizer)))
    return seqs


def result_json(seq: Sequence, engine: VerifierEngine) -> dict:
    stats = engine.req_stats[seq.request_id]
    return {
        "id": seq.request_id,
        "text": seq.text,
        "token_ids": seq.output_ids,
        "num_generated": len(seq.output_ids),
        "finish_reason": seq.finish_reason,
        "num_prompt_tokens": len(seq.prompt_ids),
        "num_rounds": stats.num_rounds,
        "mean_tokens_per_round": (stats.num_accepted / stats.num_rounds + 1) if stats.num_rounds else None,
    }


def read_requests(input_path: Path, default_max_new: int) -> list[tuple[str | None, object, SamplingParams]]:
    """Parse and validate every line of a JSONL request file (ValueError naming the bad line)."""
    if not input_path.is_file():
        raise ValueError(f"input file not found: {input_path}")
    rows = []
    try:
        lines = input_path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{input_path} is not valid UTF-8") from None
    for line_no, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(parse_request(json.loads(line), line_no, default_max_new))
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {line_no}: not valid JSON ({exc.msg})") from None
    if not rows:
        raise ValueError(f"{input_path} has no requests")
    return rows


def run_batch(pair: LoadedPair, input_path: Path, output_path: Path, settings: BatchSettings) -> dict:
    """Run every request of ``input_path``; write results in input order; return engine metrics."""
    seqs = make_sequences(pair, read_requests(input_path, settings.max_new_tokens))
    if settings.mode == "ssd":
        from drafter_service.ssd_drafter import SSDConfig
        from verifier_service.local_ssd import LocalSSD, LocalSSDConfig

        cfg = LocalSSDConfig(settings.draft_path, SSDConfig(k=settings.k, num_blocks=settings.num_blocks,
                                                            block_size=settings.block_size),
                             max_num_seqs=settings.concurrency, num_blocks=settings.num_blocks,
                             block_size=settings.block_size)
        with LocalSSD(pair.target, cfg, eos_ids=pair.eos_ids) as local:
            summary = _run_engine(local.engine, seqs, output_path)
            summary["cache_hit_rate"] = local.proposer.stats.cache_hit_rate
            return summary
    return _run_engine(build_engine(pair, settings), seqs, output_path)


def _run_engine(engine: VerifierEngine, seqs: list[Sequence], output_path: Path) -> dict:
    for seq in seqs:
        engine.add(seq)
    t0 = time.perf_counter()
    done = [0]
    show = sys.stderr.isatty()

    def progress(_seq: Sequence) -> None:
        done[0] += 1
        if show:
            sys.stderr.write(f"\r[{done[0]}/{len(seqs)}] requests done")

    engine.run(on_finish=progress)
    if show:
        sys.stderr.write("\n")
    wall = time.perf_counter() - t0
    engine.blocks.check_all_free()
    with output_path.open("w", encoding="utf-8") as f:
        for seq in seqs:
            f.write(json.dumps(result_json(seq, engine)) + "\n")
    total = sum(len(s.output_ids) for s in seqs)
    return {"requests": len(seqs), "generated_tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "preemptions": engine.scheduler.num_preemptions, **engine.metrics.to_json()}
