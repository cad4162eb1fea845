"""The shipped prompt sets, and ``ssd bench --prompt-set`` through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spec_core.prompts import CHAT_SETS, chat_prompts


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
