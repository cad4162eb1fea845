"""Teacher data for draft distillation: token sequences with the target's top-k next-token distribution.

Two sources, written as resumable shards (``OUT/data/{source}-{index:05d}.npz``; a shard that exists is done):
- ``stdlib``: chunks of the stdlib source, teacher-forced through the target;
- ``gen``: the target's own responses (greedy and sampled) to code and chat prompts
  (:mod:`spec_core.training.draft_prompts`), the text SD sees at inference. Labels come from the very forwards
  that generated the text. Besides the templated chat prompts, ``num_selfinstruct`` questions are sampled from
  the target itself (its user turn, opened by a seeded starter word), which is far more varied than any template;
  they are written once to ``OUT/data/questions.json``.

Each shard holds ``tokens`` (int32, concatenated documents), ``doc_starts`` (int64 offsets), ``top_ids``
(uint16 ``[N, k]``) and ``top_logp`` (float16 ``[N, k]``): row i is the teacher's distribution of token i + 1.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DataConfig:
    stdlib_tokens: int = 1_200_000
    corpus_files: int | None = None  # the first N stdlib training files only (smoke runs); None = all
    chunk_len: int = 256
    chunks_per_shard: int = 64
    num_code_prompts: int = 640
    num_chat_prompts: int = 640
    code_max_new: int = 128
    chat_max_new: int = 160
    gen_batch: int = 32
    sampled_fraction: float = 0.5  # of chat prompts, sampled at gen_temperature (the rest greedy)
    gen_temperature: float = 0.7
    #: chat prompts whose question the target itself writes (sampled at ``question_temperature``)
    num_selfinstruct: int = 0
    #: everyday requests (:mod:`spec_core.training.prose_prompts`): the target's free prose
    num_prose_prompts: int = 0
    question_temperature: float = 1.0
    question_max_new: int = 48
    #: code continuations go on past an EOS for their whole budget, as the HumanEval measure does (ignore_eos)
    code_ignore_eos: bool = False
    top_k: int = 16
    #: teacher-forcing the stdlib: its wide forwards are fastest in bf16 where bf16 is native (auto), while
    #: emulated bf16 (AVX2-only CPUs) is several times slower than fp32
    dtype: str = "auto"
    gen_dtype: str = "float32"  # self-generation (narrow decode steps are faster in fp32 here)
    seed: int = 0


def _topk(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = logp.topk(k, dim=-1)
    return idx.to(torch.int32).numpy().astype(np.uint16), vals.numpy().astype(np.float16)


def save_shard(path: Path, docs: list[np.ndarray], ids: list[np.ndarray], logp: list[np.ndarray]) -> None:
    tokens = np.concatenate(docs).astype(np.int32)
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]]).astype(np.int64)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=tokens, doc_starts=starts, top_ids=np.concatenate(ids), top_logp=np.concatenate(logp))
    tmp.replace(path)


def load_shards(data_dir: Path, prefix: str = "") -> list[dict]:
    """Every finished shard (sorted by name), with its source as ``kind`` (``stdlib`` or ``gen``)."""
    return [dict(np.load(p), kind=p.name.split("-")[0])
            for p in sorted(data_dir.glob(f"{prefix}*.npz")) if ".tmp" not in p.name]


def stdlib_chunks(tokenizer, corpus, cfg: DataConfig) -> list[np.ndarray]:
    """The training files (sorted, shuffled by seed), tokenized and cut into ``chunk_len`` pieces."""
    if cfg.stdlib_tokens <= 0:
        return []
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(corpus.train))
    chunks: list[np.ndarray] = []
    total = 0
    for i in order:
        ids = np.asarray(tokenizer(corpus.train[i][1])["input_ids"], dtype=np.int32)
        for s in range(0, len(ids) - 32, cfg.chunk_len):
            chunks.append(ids[s:s + cfg.chunk_len])
            total += len(chunks[-1])
            if total >= cfg.stdlib_tokens:
                return chunks
    return chunks


@torch.inference_mode()
def label_chunks(runner, chunks: list[np.ndarray], k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Teacher-force each chunk (batched by equal length) and keep the top-k of every position."""
    ids_out, logp_out = [None] * len(chunks), [None] * len(chunks)
    by_len: dict[int, list[int]] = {}
    for i, c in enumerate(chunks):
        by_len.setdefault(len(c), []).append(i)
    for length, idxs in by_len.items():
        for s in range(0, len(idxs), 4):
            group = idxs[s:s + 4]
            x = torch.from_numpy(np.stack([chunks[i] for i in group]).astype(np.int64))
            cache = runner.new_cache(len(group), length)
            logits = runner.forward(cache, x, torch.arange(length)[None].expand(len(group), -1))
            for j, i in enumerate(group):
                ids_out[i], logp_out[i] = _topk(logits[j], k)
    return ids_out, logp_out


@torch.inference_mode()
def generate_labeled(runner, prompts: list[list[int]], max_new: int, temperature: float, eos_ids: tuple[int, ...],
                     k: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Continue every prompt (one batch) for up to ``max_new`` tokens; each document is prompt + response.

    Returns the documents and their top-k labels. Rows stop at an EOS id (kept as the last token); with no
    ``eos_ids`` they run for the whole budget.
    """
    gen = torch.Generator().manual_seed(seed)
    n = len(prompts)
    max_len = max(len(p) for p in prompts) + max_new + 1
    cache = runner.new_cache(n, max_len)
    labels_ids: list[list[np.ndarray]] = [[] for _ in range(n)]
    labels_lp: list[list[np.ndarray]] = [[] for _ in range(n)]
    last = torch.zeros(n, runner.vocab_size)
    for i, p in enumerate(prompts):
        x = torch.tensor([p])
        lg = runner.forward(cache, x, torch.arange(len(p))[None], rows=torch.tensor([i]))[0]
        a, b = _topk(lg, k)
        labels_ids[i].append(a)
        labels_lp[i].append(b)
        last[i] = lg[-1]
    seqs = [list(p) for p in prompts]
    done = [False] * n
    for _ in range(max_new):
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=gen)[:, 0]
        else:
            nxt = last.argmax(-1)
        for i in range(n):
            if not done[i]:
                seqs[i].append(int(nxt[i]))
                done[i] = int(nxt[i]) in eos_ids
        if all(done):
            break
        live = [i for i in range(n) if not done[i]]
        rows = torch.tensor(live)
        pos = torch.tensor([[len(seqs[i]) - 1] for i in live])
        lg = runner.forward(cache, nxt[rows][:, None], pos, rows=rows)[:, 0]
        a, b = _topk(lg, k)
        for j, i in enumerate(live):
            labels_ids[i].append(a[j:j + 1])
            labels_lp[i].append(b[j:j + 1])
            last[i] = lg[j]
    docs, ids, lps = [], [], []
    for i in range(n):
        doc = np.asarray(seqs[i], dtype=np.int32)
        li, lp = np.concatenate(labels_ids[i]), np.concatenate(labels_lp[i])
        if len(li) < len(doc):  # the final token (EOS or the budget's end) has no label row yet: pad with itself
            li = np.concatenate([li, np.repeat(li[-1:], len(doc) - len(li), 0)])
            lp = np.concatenate([lp, np.repeat(lp[-1:], len(doc) - len(lp), 0)])
        docs.append(doc)
        ids.append(li[:len(doc)])
        lps.append(lp[:len(doc)])
    return docs, ids, lps


def make_stdlib_data(runner, tokenizer, corpus, cfg: DataConfig, data_dir: Path, progress) -> None:
    chunks = stdlib_chunks(tokenizer, corpus, cfg)
    n_shards = math.ceil(len(chunks) / cfg.chunks_per_shard)
    bar = progress(total=sum(len(c) for c in chunks), desc="teacher: stdlib", unit="tok")
    for s in range(n_shards):
        part = chunks[s * cfg.chunks_per_shard:(s + 1) * cfg.chunks_per_shard]
        path = data_dir / f"stdlib-{s:05d}.npz"
        if not path.exists():
            ids, logp = label_chunks(runner, part, cfg.top_k)
            save_shard(path, part, ids, logp)
        bar.update(sum(len(c) for c in part))
    bar.close()


def question_prefix(tokenizer, starter: str) -> list[int]:
    """The chat template up to the user's content, then ``starter``: the target continues the user turn."""
    mark = "\x00QUESTION\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    return tokenizer(text[: text.index(mark)] + starter)["input_ids"]


@dataclass(frozen=True, slots=True)
class Shard:
    """This process's share of the generation: batches ``j`` with ``j % count == index`` (``--shard I/N``).

    Shards write into the same folder; each batch's result is the same whichever process makes it, so any split
    (and any resume) gives the same data.
    """

    index: int = 0
    count: int = 1

    def owns(self, j: int) -> bool:
        return j % self.count == self.index


#: the whole generation in one process
ONE_PROCESS = Shard()


def self_instruct_questions(runner, tokenizer, eos_ids, cfg: DataConfig, data_dir: Path, progress,
                            shard: Shard = ONE_PROCESS, poll_s: float = 10.0) -> list[str]:
    """``cfg.num_selfinstruct`` user questions written by the target (seeded; cached in ``questions.json``).

    Each batch of questions is its own file (``questions-{batch}.json``), made by the shard that owns it; every
    shard then waits for the others' batches and joins them in order.
    """
    import json
    import os
    import random
    import time

    from spec_core.training.draft_prompts import QUESTION_STARTERS

    path = data_dir / "questions.json"
    if path.exists():
        return json.loads(path.read_text())
    rng = random.Random(cfg.seed)
    starters = [rng.choice(QUESTION_STARTERS) for _ in range(cfg.num_selfinstruct)]
    starts = range(0, len(starters), cfg.gen_batch)
    part = lambda s: data_dir / f"questions-{s // cfg.gen_batch:05d}.json"  # noqa: E731
    bar = progress(total=len(starters), desc="teacher: questions", unit="q")
    for b, s in enumerate(starts):
        batch = starters[s:s + cfg.gen_batch]
        if shard.owns(b) and not part(s).exists():
            prompts = [question_prefix(tokenizer, st) for st in batch]
            docs, _, _ = generate_labeled(runner, prompts, cfg.question_max_new, cfg.question_temperature, eos_ids,
                                          1, cfg.seed + 100_000 + s)
            texts = [(st + tokenizer.decode(d[len(p):], skip_special_tokens=True)).strip()
                     for st, p, d in zip(batch, prompts, docs)]
            tmp = part(s).with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(texts))
            tmp.replace(part(s))
        bar.update(len(batch))
    bar.close()
    while not all(part(s).exists() for s in starts):  # another shard's batches
        time.sleep(poll_s)
    out = [q for s in starts for q in json.loads(part(s).read_text())]
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(out, indent=0) + "\n")
    tmp.replace(path)
    return out


def gen_jobs(tokenizer, corpus, cfg: DataConfig, questions: list[str] = ()) -> list[tuple[list[list[int]], int, float, bool]]:
    """The generation batches: (prompt ids, max_new, temperature, stop at EOS), deterministic for the config."""
    from spec_core.training.draft_prompts import build_prompts, usable_question
    from spec_core.training.prose_prompts import build_prose_prompts

    code, chats = build_prompts(corpus, cfg.num_code_prompts, cfg.num_chat_prompts, cfg.seed)
    chats += [[{"role": "user", "content": q}] for q in questions if usable_question(q)]
    chats += [[{"role": "user", "content": q}] for q in build_prose_prompts(cfg.num_prose_prompts, cfg.seed)]
    code_ids = [tokenizer(c)["input_ids"][-384:] for c in code]
    chat_ids = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)
                ["input_ids"][-384:] for m in chats]
    if questions or cfg.num_prose_prompts:  # mix every kind into both the greedy and the sampled share
        chat_ids = [chat_ids[i] for i in np.random.default_rng(cfg.seed).permutation(len(chat_ids))]
    n_sampled = int(len(chat_ids) * cfg.sampled_fraction)
    jobs = []
    for ids, max_new, temp, stop in ((code_ids, cfg.code_max_new, 0.0, not cfg.code_ignore_eos),
                                     (chat_ids[n_sampled:], cfg.chat_max_new, 0.0, True),
                                     (chat_ids[:n_sampled], cfg.chat_max_new, cfg.gen_temperature, True)):
        ids = sorted(ids, key=len)
        for s in range(0, len(ids), cfg.gen_batch):
            jobs.append((ids[s:s + cfg.gen_batch], max_new, temp, stop))
    # interleave kinds so a partial run already has all three
    order = sorted(range(len(jobs)), key=lambda j: (j % 7, j))
    return [jobs[j] for j in order]


def make_gen_data(runner, tokenizer, corpus, eos_ids, cfg: DataConfig, data_dir: Path, progress,
                  shard: Shard = ONE_PROCESS) -> None:
    questions = self_instruct_questions(runner, tokenizer, eos_ids, cfg, data_dir, progress, shard) \
        if cfg.num_selfinstruct else []
    jobs = gen_jobs(tokenizer, corpus, cfg, questions)
    bar = progress(total=len(jobs), desc="teacher: self-generated", unit="batch")
    for j, (prompts, max_new, temp, stop) in enumerate(jobs):
        path = data_dir / f"gen-{j:05d}.npz"
        if shard.owns(j) and not path.exists():
            docs, ids, logp = generate_labeled(runner, prompts, max_new, temp, eos_ids if stop else (), cfg.top_k,
                                               cfg.seed + j)
            save_shard(path, docs, ids, logp)
        bar.update(1)
    bar.close()
