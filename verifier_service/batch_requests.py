"""The ``ssd batch`` input file and settings: parsed and validated before any model loads (so a bad file or flag
fails in a fraction of a second). Imports nothing heavy: no torch, no transformers.

Input lines: ``{"prompt": str | "prompt_token_ids": [int] | "messages": [{"role", "content"}], "id"?,
"max_new_tokens"?, "temperature"?, "top_p"?, "top_k"?, "seed"?, "stop"?, "stop_token_ids"?, "ignore_eos"?}``.
``messages`` go through the model's chat template (assistant turn opened).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spec_core.chat import ChatPrompt
from spec_core.config import DEFAULT_K, SamplingParams

_PARAM_KEYS = {"max_new_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int,
               "ignore_eos": bool}


@dataclass(frozen=True, slots=True)
class BatchSettings:
    mode: str = "sd"
    concurrency: int = 8
    k: int = DEFAULT_K
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
    prompt, ids, messages = row.get("prompt"), row.get("prompt_token_ids"), row.get("messages")
    if sum(x is not None for x in (prompt, ids, messages)) != 1:
        raise ValueError(f'{where}: give exactly one of "prompt", "prompt_token_ids" or "messages"')
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
    if messages is not None:
        return (str(rid) if rid is not None else None), ChatPrompt.of(messages, f"{where}: messages"), params
    return (str(rid) if rid is not None else None), (prompt if prompt is not None else ids), params


def read_requests(input_path: Path, default_max_new: int) -> list[tuple[str, object, SamplingParams]]:
    """Parse and validate every line of a JSONL request file (ValueError naming the bad line); every request
    gets a unique id (:func:`assign_ids`)."""
    if not input_path.is_file():
        raise ValueError(f"input file not found: {input_path}")
    rows = []
    try:
        lines = input_path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{input_path} is not valid UTF-8") from None
    line_nos = []
    for line_no, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(parse_request(json.loads(line), line_no, default_max_new))
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {line_no}: not valid JSON ({exc.msg})") from None
            line_nos.append(line_no)
    if not rows:
        raise ValueError(f"{input_path} has no requests")
    ids = assign_ids([rid for rid, _, _ in rows], line_nos)
    return [(rid, prompt, params) for rid, (_, prompt, params) in zip(ids, rows)]


def assign_ids(given: list[str | None], line_nos: list[int]) -> list[str]:
    """Every request's id: the user's (which must be unique: ``ValueError`` naming both lines), else its 0-based
    index as a string, or ``line-N`` where a user already took that index, so no generated id equals a user's."""
    first: dict[str, int] = {}
    for rid, line_no in zip(given, line_nos):
        if rid is None:
            continue
        if rid in first:
            raise ValueError(f"line {line_no}: duplicate id {rid!r} (first used on line {first[rid]}); "
                             "request ids must be unique")
        first[rid] = line_no
    out, taken = [], set(first)
    for i, (rid, line_no) in enumerate(zip(given, line_nos)):
        if rid is None:
            rid = str(i)
            n = 1
            while rid in taken:
                rid, n = f"line-{line_no}" + (f"-{n}" if n > 1 else ""), n + 1
            taken.add(rid)
        out.append(rid)
    return out
