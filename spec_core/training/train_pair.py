"""``ssd train-pair``: train the shipped target/draft pair from the stdlib source, reproducibly.

Stages (each resumable from its checkpoint in ``OUT/ckpt``):
  1. tokenizer: byte-level BPE on the training files;
  2. target: a Llama model trained with next-token cross-entropy;
  3. draft: a much smaller Llama distilled from the target (KL(p_target || q_draft) on every position);
  4. eval: held-out losses and the teacher-forced top-1 agreement, written to ``OUT/report.json``.

Budgets are in optimizer steps (so a run is reproducible); ``max_minutes`` is a safety cap on wall time.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from spec_core.training.corpus import HELDOUT_FILES, load_corpus
from spec_core.training.tokenizer import encode_documents, save_tokenizer, train_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    def llama_config(self, vocab_size: int, eos_id: int, max_positions: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=max_positions,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            initializer_range=0.02,
        )


TARGET_SHAPE = ModelShape(hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2, intermediate_size=1152)
DRAFT_SHAPE = ModelShape(hidden_size=96, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=288)
TINY_SHAPE = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@dataclass(frozen=True, slots=True)
class StageConfig:
    steps: int
    lr: float
    batch_size: int
    warmup: int = 100
    weight_decay: float = 0.1
    checkpoint_every: int = 50


@dataclass(frozen=True, slots=True)
class PairConfig:
    """Everything that determines the trained pair. The defaults are the shipped recipe."""

    vocab_size: int = 8192
    seq_len: int = 512
    max_positions: int = 1024
    target: ModelShape = TARGET_SHAPE
    draft: ModelShape = DRAFT_SHAPE
    target_stage: StageConfig = field(default_factory=lambda: StageConfig(steps=720, lr=1.5e-3, batch_size=16))
    draft_stage: StageConfig = field(default_factory=lambda: StageConfig(steps=420, lr=3e-3, batch_size=16))
    max_files: int | None = None
    seed: int = 0
    bf16_autocast: bool = True
    max_minutes: float = 115.0
    eval_tokens: int = 60_000

    def __post_init__(self) -> None:
        if self.seq_len > self.max_positions:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_positions {self.max_positions}")

    @staticmethod
    def smoke() -> PairConfig:
        """A few steps on a tiny slice with tiny models: the CI smoke test."""
        return PairConfig(
            vocab_size=300,
            seq_len=64,
            max_positions=128,
            target=TINY_SHAPE,
            draft=TINY_SHAPE,
            target_stage=StageConfig(steps=3, lr=1e-3, batch_size=2, warmup=1, checkpoint_every=2),
            draft_stage=StageConfig(steps=3, lr=1e-3, batch_size=2, warmup=1, checkpoint_every=2),
            max_files=12,
            eval_tokens=2_000,
        )


class Deadline:
    """Wall-clock safety cap shared by all stages."""

    def __init__(self, minutes: float) -> None:
        self.end = time.monotonic() + minutes * 60.0

    def passed(self) -> bool:
        return time.monotonic() > self.end


def lr_at(step: int, stage: StageConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak at ``stage.steps``."""
    if step < stage.warmup:
        return stage.lr * (step + 1) / stage.warmup
    progress = min(1.0, (step - stage.warmup) / max(1, stage.steps - stage.warmup))
    return stage.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def sample_batch(tokens: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    rows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
    return torch.from_numpy(rows.astype(np.int64))


def _autocast(cfg: PairConfig):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast)


def _save_ckpt(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rng_state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "rng": rng_state}, tmp)
    tmp.replace(path)


def _make_optimizer(model: torch.nn.Module, stage: StageConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": stage.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=stage.lr, betas=(0.9, 0.95), eps=1e-8)


def _loss(model: LlamaForCausalLM, batch: torch.Tensor, teacher: LlamaForCausalLM | None) -> torch.Tensor:
    inputs, labels = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=inputs).logits.float()
    if teacher is None:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    with torch.no_grad():
        t_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
    s_logp = F.log_softmax(logits, dim=-1)
    return F.kl_div(s_logp, t_logp, log_target=True, reduction="none").sum(-1).mean()


def train_stage(
    name: str,
    model: LlamaForCausalLM,
    tokens: np.ndarray,
    cfg: PairConfig,
    stage: StageConfig,
    ckpt_dir: Path,
    deadline: Deadline,
    teacher: LlamaForCausalLM | None = None,
) -> dict:
    """Train ``model`` for ``stage.steps`` steps, checkpointing to ``ckpt_dir/name.pt`` (resumed if present)."""
    opt = _make_optimizer(model, stage)
    ckpt = ckpt_dir / f"{name}.pt"
    rng = np.random.default_rng(cfg.seed + (0 if teacher is None else 1))
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        rng.bit_generator.state = state["rng"]
        logger.info("%s: resumed at step %d", name, step)
    model.train()
    t0, losses, tokens_seen = time.monotonic(), [], 0
    while step < stage.steps and not deadline.passed():
        for g in opt.param_groups:
            g["lr"] = lr_at(step, stage)
        batch = sample_batch(tokens, stage.batch_size, cfg.seq_len, rng)
        with _autocast(cfg):
            loss = _loss(model, batch, teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += batch.numel()
        losses.append(loss.item())
        if step % 10 == 0 or step == stage.steps:
            rate = tokens_seen / (time.monotonic() - t0)
            logger.info("%s step %d/%d loss %.4f (%.0f tok/s)", name, step, stage.steps, np.mean(losses[-10:]), rate)
        if step % stage.checkpoint_every == 0 or step == stage.steps:
            _save_ckpt(ckpt, model, opt, step, rng.bit_generator.state)
    if step < stage.steps:
        _save_ckpt(ckpt, model, opt, step, rng.bit_generator.state)
        logger.warning("%s: wall-clock cap reached at step %d/%d", name, step, stage.steps)
    model.eval()
    return {"steps": step, "planned_steps": stage.steps, "wall_s": time.monotonic() - t0, "final_loss": losses[-1] if losses else None}


@torch.no_grad()
def evaluate(target: LlamaForCausalLM, draft: LlamaForCausalLM, tokens: np.ndarray, cfg: PairConfig) -> dict:
    """Held-out loss (nats/token) of both models and teacher-forced top-1 agreement, in fp32."""
    n = min(len(tokens) - 1, cfg.eval_tokens)
    t_loss = d_loss = agree = count = 0.0
    for s in range(0, n, cfg.seq_len):
        chunk = torch.from_numpy(tokens[s : min(s + cfg.seq_len + 1, n + 1)].astype(np.int64))[None]
        if chunk.shape[1] < 2:
            break
        x, y = chunk[:, :-1], chunk[:, 1:]
        tl, dl = target(input_ids=x).logits.float(), draft(input_ids=x).logits.float()
        t_loss += F.cross_entropy(tl[0], y[0], reduction="sum").item()
        d_loss += F.cross_entropy(dl[0], y[0], reduction="sum").item()
        agree += (tl.argmax(-1) == dl.argmax(-1)).sum().item()
        count += y.numel()
    return {
        "heldout_tokens": int(count),
        "target_loss": t_loss / count,
        "draft_loss": d_loss / count,
        "top1_agreement": agree / count,
    }


def _prepare_tokens(cfg: PairConfig, out: Path) -> tuple[PreTrainedTokenizerFast, np.ndarray, np.ndarray]:
    corpus = load_corpus(max_files=cfg.max_files)
    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    else:
        logger.info("training tokenizer on %d files (%.1f MB)", len(corpus.train), corpus.train_chars / 1e6)
        tokenizer = train_tokenizer([t for _, t in corpus.train], cfg.vocab_size)
        save_tokenizer(tokenizer, tok_dir)
    cache = out / "ckpt" / "tokens.npz"
    if cache.exists():
        arrays = np.load(cache)
        return tokenizer, arrays["train"], arrays["heldout"]
    train = encode_documents(tokenizer, [t for _, t in corpus.train])
    heldout = encode_documents(tokenizer, [t for _, t in corpus.heldout])
    np.savez(cache, train=train, heldout=heldout)
    logger.info("corpus: %d train tokens, %d held-out tokens", len(train), len(heldout))
    return tokenizer, train, heldout


def _export(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path) -> None:
    """Save an HF folder in bf16 (the shipped precision); loaders upcast to the dtype they ask for."""
    model.to(torch.bfloat16).save_pretrained(str(path))
    model.float()
    tokenizer.save_pretrained(str(path))


def train_pair(out: Path, cfg: PairConfig, resume: bool = False, stage: str = "all") -> dict:
    """Run the stages up to ``stage`` ('tokenizer', 'target', 'draft', 'all'); returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "ckpt").mkdir(exist_ok=True)
    if not resume and any((out / "ckpt").glob("*.pt")):
        raise ValueError(f"{out} already has checkpoints; pass --resume to continue them")
    torch.manual_seed(cfg.seed)
    deadline = Deadline(cfg.max_minutes)
    t_start = time.monotonic()
    tokenizer, train_tokens, heldout_tokens = _prepare_tokens(cfg, out)
    report: dict = {"config": asdict(cfg), "heldout_files": list(HELDOUT_FILES)}
    if stage == "tokenizer":
        return report
    eos = tokenizer.eos_token_id
    vocab = len(tokenizer)
    torch.manual_seed(cfg.seed)
    target = LlamaForCausalLM(cfg.target.llama_config(vocab, eos, cfg.max_positions))
    report["target_params"] = sum(p.numel() for p in target.parameters())
    report["target_train"] = train_stage("target", target, train_tokens, cfg, cfg.target_stage, out / "ckpt", deadline)
    _export(target, tokenizer, out / "target")
    if stage == "target":
        return report
    target.requires_grad_(False)
    torch.manual_seed(cfg.seed + 1)
    draft = LlamaForCausalLM(cfg.draft.llama_config(vocab, eos, cfg.max_positions))
    report["draft_params"] = sum(p.numel() for p in draft.parameters())
    report["draft_train"] = train_stage(
        "draft", draft, train_tokens, cfg, cfg.draft_stage, out / "ckpt", deadline, teacher=target
    )
    _export(draft, tokenizer, out / "draft")
    report["eval"] = evaluate(target, draft, heldout_tokens, cfg)
    report["wall_s_this_invocation"] = time.monotonic() - t_start
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    logger.info("eval: %s", report["eval"])
    return report


def config_from_args(smoke: bool, **overrides) -> PairConfig:
    base = PairConfig.smoke() if smoke else PairConfig()
    clean = {k: v for k, v in overrides.items() if v is not None}
    stage_keys = {"target_steps": "target_stage", "draft_steps": "draft_stage"}
    for key, stage_name in stage_keys.items():
        if key in clean:
            clean[stage_name] = replace(getattr(base, stage_name), steps=clean.pop(key))
    return replace(base, **clean)
