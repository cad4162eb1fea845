"""``ssd train-draft``: teacher data and labels, the draft vocabulary, exact resume after an interruption, a
reproducible smoke run through the CLI that exports a draft our runner pairs with the real target."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from spec_core.training.student import soft_targets
from spec_core.training.train_draft import DraftTrainConfig


def test_soft_targets_renormalise_inside_the_map():
    ids = torch.tensor([[[0, 2, -1], [-1, -1, -1]]])
    logp = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.6, 0.3, 0.1]]]))
    p, valid = soft_targets(ids, logp)
    assert valid.tolist() == [[True, False]]
    assert torch.allclose(p[0, 0], torch.tensor([2 / 3, 1 / 3, 0.0]))


def test_prompts_are_offline_and_deterministic():
    from spec_core.training.corpus import HELDOUT_FILES, load_corpus
    from spec_core.training.draft_prompts import build_prompts

    corpus = load_corpus(max_files=60)
    a, b = build_prompts(corpus, 8, 8, seed=3), build_prompts(corpus, 8, 8, seed=3)
    assert a == b and len(a[0]) == 8 and len(a[1]) == 8
    assert all(m[0]["role"] == "user" and m[0]["content"] for m in a[1])
    assert not set(HELDOUT_FILES) & {n for n, _ in corpus.train}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, real_pair):
    out = tmp_path_factory.mktemp("td") / "run"
    proc = subprocess.run([sys.executable, "-m", "ssd_cli", "train-draft", "--smoke", "--out", str(out),
                           "--threads", "1"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout), proc.stderr


def test_smoke_run_exports_a_draft_for_the_real_target(smoke_run, real_pair):
    from spec_core.config import ModelConfig
    from spec_core.models import load_pair

    out, report, stderr = smoke_run
    assert "train-draft" in stderr  # the progress bar
    assert report["steps"] == 3 and report["draft_vocab"] == 2048 and report["train_tokens"] > 0
    draft = out / "draft"
    token_map = json.loads((draft / "token_map.json").read_text())
    assert len(token_map) == 2048 and {0, 1, 2} <= set(token_map)
    pair = load_pair(ModelConfig(real_pair["target"]), ModelConfig(str(draft)))  # same tokenizer, vocabulary
    assert pair.draft.token_map.tolist() == token_map
    shards = sorted(p.name for p in (out / "data").glob("*.npz"))
    assert any(n.startswith("stdlib-") for n in shards) and any(n.startswith("gen-") for n in shards)


def test_greedy_labels_continue_the_documents(smoke_run, real_pair):
    """Each generated document is its prompt plus the response; in a greedy one the teacher's top-1 at every
    response position is the next token, so labels and tokens line up."""
    from spec_core.models import load_tokenizer
    from spec_core.training.corpus import load_corpus
    from spec_core.training.draft_data import gen_jobs, load_shards

    out, _, _ = smoke_run
    cfg = DraftTrainConfig.smoke().data
    jobs = gen_jobs(load_tokenizer(real_pair["target"]), load_corpus(max_files=40), cfg)
    shards = load_shards(out / "data", "gen")
    assert len(shards) == len(jobs)
    greedy_seen = 0
    for shard, (prompts, _, temperature, _stop) in zip(shards, jobs):
        assert shard["top_ids"].shape[1] == cfg.top_k
        starts = list(shard["doc_starts"]) + [len(shard["tokens"])]
        for (a, b), prompt in zip(zip(starts[:-1], starts[1:]), prompts):
            toks, top1 = shard["tokens"][a:b], shard["top_ids"][a:b, 0].astype(np.int64)
            assert toks[:len(prompt)].tolist() == prompt and b - a > len(prompt)
            if temperature == 0:
                greedy_seen += 1
                assert (top1[len(prompt) - 1:-1] == toks[len(prompt):]).all()
    assert greedy_seen > 0


def test_rerun_resumes_and_is_reproducible(smoke_run, tmp_path, real_pair):
    """A second run in the same folder does no new work; a run in a fresh folder gives the same weights."""
    out, report, _ = smoke_run
    again = subprocess.run([sys.executable, "-m", "ssd_cli", "train-draft", "--smoke", "--out", str(out),
                            "--threads", "1"], capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "resumed at step 3" in again.stderr
    other = tmp_path / "other"
    shutil.copytree(out / "data", other / "data")  # teacher data is deterministic too; reuse it for time
    shutil.copy(out / "train_config.json", other / "train_config.json")
    proc = subprocess.run([sys.executable, "-m", "ssd_cli", "train-draft", "--smoke", "--out", str(other),
                           "--threads", "1"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a = torch.load(out / "ckpt" / "student.pt", weights_only=False)["model"]
    b = torch.load(other / "ckpt" / "student.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Interrupt:
    """A progress bar that interrupts training after ``after`` steps (a simulated crash)."""

    def __init__(self, after: int) -> None:
        self.after, self.n = after, 0

    def __call__(self, **_kw):
        return self

    def update(self, n: int) -> None:
        self.n += n
        if self.n >= self.after:
            raise KeyboardInterrupt

    def set_postfix(self, **_kw) -> None:
        pass

    def close(self) -> None:
        pass


def test_interrupted_training_resumes_exactly(smoke_run, tmp_path, real_pair):
    from dataclasses import replace

    from spec_core.training.student import train_student

    out, _, _ = smoke_run
    base = DraftTrainConfig.smoke()
    cfg = replace(base, train=replace(base.train, steps=4, ckpt_every=2))
    runs = {}
    for name, interrupt in (("straight", None), ("interrupted", 2)):
        d = tmp_path / name
        shutil.copytree(out / "data", d / "data")
        shutil.copy(out / "token_map.npy", d / "token_map.npy")
        if interrupt:
            with pytest.raises(KeyboardInterrupt):
                train_student(d, real_pair["target"], cfg, _Interrupt(interrupt))
            assert torch.load(d / "ckpt" / "student.pt", weights_only=False)["step"] == 2
        train_student(d, real_pair["target"], cfg, _Interrupt(10**9))
        runs[name] = torch.load(d / "ckpt" / "student.pt", weights_only=False)["model"]
    assert all(torch.equal(runs["straight"][k], runs["interrupted"][k]) for k in runs["straight"])


def test_bad_stage_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ssd_cli", "train-draft", "--out", str(tmp_path), "--stage", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("ssd: error:") and "--stage" in proc.stderr


def test_training_prompts_share_nothing_with_the_eval_prompts():
    """No HumanEval prompt line and none of our chat eval questions appears in the draft's training prompts."""
    from spec_core.prompts import chat_prompts, humaneval_prompts
    from spec_core.training.corpus import load_corpus
    from spec_core.training.draft_data import DataConfig
    from spec_core.training.draft_prompts import build_prompts

    cfg = DataConfig()
    code, chats = build_prompts(load_corpus(), cfg.num_code_prompts, cfg.num_chat_prompts, cfg.seed)
    train_text = "\n".join(code + [m[0]["content"] for m in chats])
    he_lines = {ln.strip() for p in humaneval_prompts() for ln in p.splitlines() if len(ln.strip()) >= 40}
    assert he_lines and not [ln for ln in he_lines if ln in train_text]
    questions = [p.messages[-1][1] for p in chat_prompts()]
    assert not [q for q in questions if q in train_text]


def test_init_continues_an_exported_draft(tmp_path, real_pair):
    """``--init``: the fine-tune recipe starts from the draft's weights and keeps its vocabulary; its data is the
    target's own questions and answers (no stdlib pass)."""
    from safetensors.torch import load_file

    init = Path(real_pair["draft"])
    out = tmp_path / "ft"
    proc = subprocess.run([sys.executable, "-m", "ssd_cli", "train-draft", "--smoke", "--init", str(init), "--out",
                           str(out), "--threads", "1"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "draft" / "token_map.json").read_text()) == json.loads(
        (init / "token_map.json").read_text())
    questions = json.loads((out / "data" / "questions.json").read_text())
    assert len(questions) == 4 and all(isinstance(q, str) and q for q in questions)
    shards = sorted(p.name for p in (out / "data").glob("*.npz"))
    assert shards and all(n.startswith("gen-") for n in shards)
    a = load_file(str(init / "model.safetensors"))["model.embed_tokens.weight"].float()
    b = load_file(str(out / "draft" / "model.safetensors"))["model.embed_tokens.weight"].float()
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99  # started from it
    bad = subprocess.run([sys.executable, "-m", "ssd_cli", "train-draft", "--smoke", "--init", real_pair["target"],
                          "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "not an exported draft" in bad.stderr


#: words naming the topics of our chat eval set (spec_core/assets/chat_prompts.jsonl): the chat recipe's everyday
#: requests must not touch them
EVAL_TOPIC_WORDS = ("focus", "working from home", "weather", "climate", "teacher", "tomato", "sauce", "prime", "water", "sunset",
                    "beach", "leaves", "autumn", "coffee", "camping", "rainbow", "limerick", "cat", "lungs",
                    "handwriting", "arctic", "librarian", "tic-tac-toe", "exam", "boiling", "sun",
                    "gravity", "guitar", "cinderella", "exercise", "brain")


def test_prose_prompts_are_deterministic_and_avoid_the_eval_topics():
    import re

    from spec_core.prompts import chat_prompts
    from spec_core.training.prose_prompts import TASKS, THINGS, build_prose_prompts

    a = build_prose_prompts(500, seed=4)
    assert a == build_prose_prompts(500, seed=4) != build_prose_prompts(500, seed=5)
    assert len(set(a)) == 500
    questions = {p.messages[-1][1] for p in chat_prompts()}
    assert not questions & set(build_prose_prompts(10**6, seed=0))
    words = re.compile(r"\b(" + "|".join(map(re.escape, EVAL_TOPIC_WORDS)) + r")s?\b", re.IGNORECASE)
    assert all(words.search(q) for q in questions)  # the list names every eval question's topic
    assert not [t for t in THINGS + TASKS if words.search(t)]


def test_recipes_set_the_mix():
    from spec_core.training.train_draft import RECIPES

    draft = "spec_core/assets/models/smollm2-draft"
    mixed = DraftTrainConfig.finetune(draft, seed=2, scale=2).data  # the third stage's recipe, unchanged
    assert (mixed.num_code_prompts, mixed.num_chat_prompts, mixed.num_selfinstruct, mixed.num_prose_prompts) == (
        2200, 2000, 2800, 0)
    chat = DraftTrainConfig.finetune(draft, seed=4, scale=1.5, recipe="chat").data
    assert chat.num_prose_prompts == round(1.5 * RECIPES["chat"]["num_prose_prompts"]) > chat.num_code_prompts


def test_shard_and_recipe_flags_are_checked(tmp_path):
    from spec_core.training.draft_data import Shard

    assert [j for j in range(7) if Shard(1, 3).owns(j)] == [1, 4] and all(Shard().owns(j) for j in range(3))
    for flags, msg in ((["--stage", "train", "--shard", "0/2"], "data-gen only"),
                       (["--stage", "data-gen", "--shard", "2/2"], "0 <= I < N"),
                       (["--stage", "data-gen", "--shard", "x"], "I/N"),
                       (["--recipe", "chat"], "give --init"),
                       (["--init", "spec_core/assets/models/smollm2-draft", "--recipe", "x"], "unknown --recipe")):
        proc = subprocess.run([sys.executable, "-m", "ssd_cli", "train-draft", "--out", str(tmp_path), *flags],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.startswith("ssd: error:") and msg in proc.stderr, proc.stderr


def test_sharded_generation_makes_every_batch_once(tmp_path, real_pair):
    """Two ``--shard`` processes on one folder (the chat recipe, with everyday requests): the questions are joined
    in order, and every batch is there once, holding its own prompts."""
    from spec_core.models import load_tokenizer
    from spec_core.training.corpus import load_corpus
    from spec_core.training.draft_data import DataConfig, gen_jobs, load_shards
    from spec_core.training.prose_prompts import build_prose_prompts

    out = tmp_path / "sharded"
    cmd = [sys.executable, "-m", "ssd_cli", "train-draft", "--smoke", "--init", real_pair["draft"], "--recipe", "chat",
           "--out", str(out), "--threads", "1", "--stage", "data-gen", "--shard"]
    procs = [subprocess.Popen([*cmd, f"{i}/2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
    cfg = DataConfig(**json.loads((out / "train_config.json").read_text())["data"])
    questions = json.loads((out / "data" / "questions.json").read_text())
    assert cfg.num_prose_prompts == 4 and len(questions) == cfg.num_selfinstruct
    jobs = gen_jobs(load_tokenizer(real_pair["target"]), load_corpus(max_files=cfg.corpus_files), cfg, questions)
    shards = load_shards(out / "data", "gen")
    assert len(shards) == len(jobs) > 1
    for shard, (prompts, *_rest) in zip(shards, jobs):
        starts = list(shard["doc_starts"]) + [len(shard["tokens"])]
        assert [shard["tokens"][a:a + len(p)].tolist() for a, p in zip(starts, prompts)] == prompts
    tok = load_tokenizer(real_pair["target"])
    text = "\n".join(tok.decode(s["tokens"]) for s in shards)
    assert all(q in text for q in build_prose_prompts(cfg.num_prose_prompts, cfg.seed))
