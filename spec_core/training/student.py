"""The draft student: a small Llama over the target's tokenizer, with a reduced output vocabulary.

Input embeddings cover the full vocabulary (any token can appear in the context). The output head is the tied
embedding restricted to ``token_map`` (the draft vocabulary, ascending ids): the draft's proposal q is zero
outside the map, which the runner makes explicit by scattering the head's logits into a full-vocabulary row of
``-inf`` (:class:`spec_core.runner.ModelRunner`), so verification stays exact.

Training is soft cross-entropy against the teacher's top-k next-token distribution, renormalised over the entries
that fall inside the map.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from spec_core.arch import TOKEN_MAP_FILE
from spec_core.config import native_bf16
from spec_core.training.draft_data import load_shards

logger = logging.getLogger(__name__)

SPECIAL_IDS = (0, 1, 2)


def build_token_map(out: Path, cfg) -> np.ndarray:
    """The ``cfg.draft_vocab`` ids most often the teacher's next-token top-1 (with the special ids).

    A run started from an exported draft (``cfg.init_from``) keeps that draft's map: its head rows are that map.
    """
    if cfg.init_from:
        keep = np.asarray(json.loads((Path(cfg.init_from) / TOKEN_MAP_FILE).read_text()), dtype=np.int64)
        np.save(out / "token_map.npy", keep)
        return keep
    counts = np.zeros(65536, dtype=np.int64)
    for shard in load_shards(out / "data"):
        counts += np.bincount(shard["top_ids"][:, 0].astype(np.int64), minlength=65536)
    counts[list(SPECIAL_IDS)] = counts.max() + 1
    keep = np.sort(np.argsort(-counts, kind="stable")[: cfg.draft_vocab])
    coverage = counts[keep].sum() / max(1, counts.sum())
    np.save(out / "token_map.npy", keep.astype(np.int64))
    logger.info("draft vocabulary: %d ids cover %.4f of the teacher's top-1 tokens", len(keep), coverage)
    return keep


def student_config(target_path: str, cfg):
    from transformers import AutoConfig, LlamaConfig

    t = AutoConfig.from_pretrained(target_path)
    s = cfg.shape
    return LlamaConfig(
        vocab_size=t.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        max_position_embeddings=t.max_position_embeddings, rms_norm_eps=1e-5,
        rope_parameters=dict(t.rope_parameters) if getattr(t, "rope_parameters", None) else None,
        tie_word_embeddings=True, bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id,
        pad_token_id=getattr(t, "pad_token_id", None), initializer_range=0.02,
    )


def pca_embedding(target_path: str, dim: int, std: float = 0.05) -> torch.Tensor:
    """The target's input embedding projected on its top ``dim`` principal directions (a warm start)."""
    from safetensors import safe_open

    with safe_open(str(Path(target_path) / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight").float()
    centered = emb - emb.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(centered[::4], full_matrices=False)
    proj = centered @ v[:dim].T
    return proj * (std / proj.std())


class Batches:
    """Random windows of ``seq_len`` tokens from teacher documents, with their labels (seeded)."""

    def __init__(self, shards: list[dict], token_map: np.ndarray, seq_len: int, heldout_every: int, seed: int):
        self.seq_len = seq_len
        self.rng = np.random.default_rng(seed)
        inv = np.full(65536, -1, dtype=np.int64)
        inv[token_map] = np.arange(len(token_map))
        self.docs, self.heldout = [], []
        gen = [shard for shard in shards if shard.get("kind") == "gen"]
        self.gen_shards, self.gen_documents = len(gen), sum(len(shard["doc_starts"]) for shard in gen)
        for shard in shards:
            toks, starts = shard["tokens"], list(shard["doc_starts"]) + [len(shard["tokens"])]
            mapped = inv[shard["top_ids"].astype(np.int64)]
            for j, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
                doc = (toks[a:b], mapped[a:b], shard["top_logp"][a:b])
                gen = shard.get("kind") == "gen"
                (self.heldout if gen and j % heldout_every == 0 else self.docs).append(doc)
        self.weights = np.array([len(d[0]) for d in self.docs], dtype=np.float64)
        self.weights /= self.weights.sum()

    @property
    def num_tokens(self) -> int:
        return int(sum(len(d[0]) for d in self.docs))

    def window(self, doc) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        toks, ids, lp = doc
        if len(toks) > self.seq_len:
            s = int(self.rng.integers(0, len(toks) - self.seq_len + 1))
            toks, ids, lp = toks[s:s + self.seq_len], ids[s:s + self.seq_len], lp[s:s + self.seq_len]
        return toks, ids, lp

    def collate(self, docs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids ``[n, T]``, label ids in map indices (-1 = outside the map or padding) and log-probs."""
        n, t = len(docs), self.seq_len
        x = np.zeros((n, t), dtype=np.int64)
        ids = np.full((n, t, docs[0][1].shape[1]), -1, dtype=np.int64)
        lp = np.full((n, t, docs[0][1].shape[1]), -np.inf, dtype=np.float32)
        for i, (a, b, c) in enumerate(docs):
            x[i, :len(a)], ids[i, :len(a)], lp[i, :len(a)] = a, b, c
        return torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(lp)

    def sample(self, batch_tokens: int):
        n = max(1, batch_tokens // self.seq_len)
        picks = self.rng.choice(len(self.docs), size=n, p=self.weights)
        return self.collate([self.window(self.docs[i]) for i in picks])


def soft_targets(ids: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher probabilities renormalised over the in-map entries; rows with none are masked out."""
    inside = ids >= 0
    p = torch.where(inside, logp.exp(), torch.zeros_like(logp))
    mass = p.sum(-1, keepdim=True)
    valid = mass[..., 0] > 0
    return p / mass.clamp_min(1e-9), valid


def student_logits(model, x: torch.Tensor, token_map: torch.Tensor) -> torch.Tensor:
    h = model.model(input_ids=x).last_hidden_state
    return h @ model.model.embed_tokens.weight[token_map].T


def distill_loss(model, x, ids, logp, token_map) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy (nats/token) and teacher-forced top-1 agreement over valid positions."""
    logq = torch.log_softmax(student_logits(model, x, token_map).float(), -1)
    p, valid = soft_targets(ids, logp)
    gathered = torch.gather(logq, -1, ids.clamp_min(0))
    loss_tok = -(p * gathered).sum(-1)
    loss = loss_tok[valid].mean()
    agree = (logq.argmax(-1) == ids[..., 0])[valid].float().mean()
    return loss, agree


def lr_at(step: int, tc) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    frac = min(1.0, (step - tc.warmup) / max(1, tc.steps - tc.warmup))
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * frac))


def _load_data(out: Path, cfg) -> tuple[Batches, torch.Tensor]:
    token_map = np.load(out / "token_map.npy")
    shards = load_shards(out / "data")
    data = Batches(shards, token_map, cfg.train.seq_len, int(1 / cfg.train.heldout_fraction), cfg.seed)
    return data, torch.from_numpy(token_map)


def new_student(out: Path, target_path: str, cfg):
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(student_config(target_path, cfg))
    with torch.no_grad():
        if cfg.init_from:  # the exported draft's weights (bf16 on disk), as fp32 master weights
            init = LlamaForCausalLM.from_pretrained(cfg.init_from, torch_dtype=torch.float32)
            model.load_state_dict(init.state_dict())
        else:
            model.model.embed_tokens.weight.copy_(pca_embedding(target_path, cfg.shape.hidden_size))
    return model


def train_student(out: Path, target_path: str, cfg, progress) -> None:
    tc = cfg.train
    data, token_map = _load_data(out, cfg)
    logger.info("student data: %d documents, %d tokens (%d held out)", len(data.docs), data.num_tokens,
                len(data.heldout))
    model = new_student(out, target_path, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    ckpt = out / "ckpt" / "student.pt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    step, log = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, log = state["step"], state["log"]
        data.rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        logger.info("student: resumed at step %d", step)
    model.train()
    autocast = tc.bf16_autocast and native_bf16()  # else autocast would only slow training
    bar = progress(total=tc.steps, initial=step, desc="train-draft", unit="step")
    t0, ema = time.time(), None
    while step < tc.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        x, ids, logp = data.sample(tc.batch_tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, agree = distill_loss(model, x, ids, logp, token_map)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        cur = (float(loss.detach()), float(agree))
        ema = cur if ema is None else (0.98 * ema[0] + 0.02 * cur[0], 0.98 * ema[1] + 0.02 * cur[1])
        if step % tc.ckpt_every == 0 or step == tc.steps:
            log.append({"step": step, "loss": round(ema[0], 4), "train_agree": round(ema[1], 4),
                        "lr": lr_at(step, tc), "seconds": round(time.time() - t0, 1)})
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                        "rng": data.rng.bit_generator.state, "torch_rng": torch.get_rng_state()}, tmp)
            tmp.replace(ckpt)
        bar.update(1)
        bar.set_postfix(loss=f"{ema[0]:.3f}", agree=f"{ema[1]:.3f}")
    bar.close()


@torch.no_grad()
def heldout_agreement(model, docs, token_map: torch.Tensor, seq_len: int) -> dict:
    """Teacher-forced top-1 agreement and soft cross-entropy over whole held-out documents (first ``seq_len``)."""
    model.eval()
    hits = n = 0
    nll = 0.0
    for toks, ids, lp in docs:
        x = torch.from_numpy(toks[:seq_len].astype(np.int64))[None]
        i = torch.from_numpy(ids[:seq_len])[None]
        logq = torch.log_softmax(student_logits(model, x, token_map).float(), -1)
        p, valid = soft_targets(i, torch.from_numpy(lp[:seq_len].astype(np.float32))[None])
        hits += int((logq.argmax(-1) == i[..., 0])[valid].sum())
        nll += float(-(p * torch.gather(logq, -1, i.clamp_min(0))).sum(-1)[valid].sum())
        n += int(valid.sum())
    return {"top1_agreement": hits / max(1, n), "soft_ce": nll / max(1, n), "tokens": n}


def heldout_stdlib_docs(target_path: str, token_map: torch.Tensor, cfg) -> list:
    """The held-out stdlib files (never trained on), teacher-labelled in fp32, as (tokens, map ids, log-probs)."""
    from spec_core.models import load_tokenizer
    from spec_core.runner import ModelRunner
    from spec_core.training.corpus import load_corpus
    from spec_core.training.draft_data import label_chunks

    max_tokens = cfg.train.heldout_stdlib_tokens
    if not max_tokens:
        return []
    tok = load_tokenizer(target_path)
    chunks, total = [], 0
    for _, text in load_corpus().heldout:
        ids = np.asarray(tok(text)["input_ids"], dtype=np.int32)
        for s in range(0, len(ids) - 64, cfg.data.chunk_len):
            if total >= max_tokens:
                break
            chunks.append(ids[s:s + cfg.data.chunk_len])
            total += len(chunks[-1])
    ids, logp = label_chunks(ModelRunner(target_path), chunks, cfg.data.top_k)
    inv = np.full(65536, -1, dtype=np.int64)
    inv[token_map.numpy()] = np.arange(len(token_map))
    return [(c, inv[i.astype(np.int64)], lp) for c, i, lp in zip(chunks, ids, logp)]


def export_draft(out: Path, target_path: str, cfg) -> dict:
    """Write ``OUT/draft`` (bf16 safetensors, the target's tokenizer, the token map) and ``OUT/report.json``."""
    from transformers import AutoTokenizer

    data, token_map = _load_data(out, cfg)
    model = new_student(out, target_path, cfg)
    state = torch.load(out / "ckpt" / "student.pt", weights_only=False)
    model.load_state_dict(state["model"])
    dest = out / "draft"
    dest.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(dest)  # what ships
    model.float()  # and what is evaluated: the same bf16-rounded weights, computed in fp32
    AutoTokenizer.from_pretrained(target_path).save_pretrained(dest)
    (dest / TOKEN_MAP_FILE).write_text(json.dumps([int(i) for i in token_map]) + "\n")
    report = {
        "steps": state["step"],
        "train_log": state["log"],
        "params": sum(p.numel() for p in model.parameters()),
        "draft_vocab": len(token_map),
        "train_tokens": data.num_tokens,
        "gen_documents": data.gen_documents,
        "gen_shards": data.gen_shards,
        "bf16_autocast": bool(cfg.train.bf16_autocast and native_bf16()),
        "heldout_gen": heldout_agreement(model, data.heldout, token_map, 512),
        "heldout_stdlib": heldout_agreement(model, heldout_stdlib_docs(target_path, token_map, cfg), token_map, 512),
    }
    old = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    if old.get("steps") == report["steps"] and "sd" in old:
        report["sd"] = old["sd"]  # measured for these same weights
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    from spec_core.training.draft_card import write_card

    write_card(dest, report, cfg)
    logger.info("draft exported to %s: %s", dest, report["heldout_gen"])
    return report

