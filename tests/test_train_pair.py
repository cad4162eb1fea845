"""The training command's smoke path: a few steps on a tiny slice, producing loadable HF folders."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spec_core.training.corpus import HELDOUT_FILES, load_corpus


def test_corpus_excludes_tests_and_heldout():
    corpus = load_corpus()
    names = [n for n, _ in corpus.train]
    assert not any("/test" in f"/{n}" for n in names)
    assert not set(HELDOUT_FILES) & set(names)
    assert {n for n, _ in corpus.heldout} == set(HELDOUT_FILES)


def test_train_pair_smoke(tmp_path):
    out = tmp_path / "pair"
    proc = subprocess.run([sys.executable, "-m", "ssd_cli", "train-pair", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["eval"]["heldout_tokens"] > 0
    for role in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(str(out / role), dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(out / role))
        assert model.config.vocab_size == len(tok)
    # --resume continues from the checkpoints instead of refusing them
    again = subprocess.run([sys.executable, "-m", "ssd_cli", "train-pair", "--smoke", "--resume", "--out", str(out)],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    refused = subprocess.run([sys.executable, "-m", "ssd_cli", "train-pair", "--smoke", "--out", str(out)],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "--resume" in refused.stderr
