"""Incremental detokenisation is UTF-8 safe, and stop strings spanning token boundaries are found."""

from __future__ import annotations

from spec_core.config import SamplingParams
from spec_core.detokenizer import IncrementalDetokenizer
from spec_core.models import load_tokenizer
from spec_core.sequence import Sequence

TEXT = "héllo wörld — ✓ 日本語 🙂 done\n"


def test_deltas_never_split_characters(toy_pair):
    tok = load_tokenizer(toy_pair["target"])
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(TEXT.split())  # multi-byte characters span several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == tok.decode(ids)
    assert any(d == "" for d in deltas)  # some tokens held back until their character completed


def test_stop_string_across_token_boundary(toy_pair):
    tok = load_tokenizer(toy_pair["target"])
    text = "def alpha():\n    return beta + gamma\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([t]) for t in ids]
    # choose a stop string that starts inside one token and ends inside the next
    i = next(j for j in range(len(pieces) - 1) if len(pieces[j]) >= 2 and len(pieces[j + 1]) >= 2)
    stop = pieces[i][-1] + pieces[i + 1][0]
    seq = Sequence("s", [1], SamplingParams(max_new_tokens=100, stop=(stop,)), detokenizer=IncrementalDetokenizer(tok))
    taken = seq.append(ids)
    assert seq.finish_reason == "stop"
    assert len(taken) == i + 2  # nothing after the token that completed the stop string
    prefix = "".join(pieces[: i + 1])[:-1]
    assert seq.text == text[: text.index(stop)] and seq.text.startswith(prefix)
