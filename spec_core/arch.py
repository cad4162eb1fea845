"""What the runner reads from a checkpoint folder besides its weights: the architecture (:class:`ArchSpec`, from
the HF config) and a draft's reduced output vocabulary (``token_map.json``, see :mod:`spec_core.runner`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from spec_core.transfer import to_device

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
TOKEN_MAP_FILE = "token_map.json"
def load_token_map(path: Path, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary of a folder (ascending, unique, in range), or None for a full-vocabulary head."""
    f = path / TOKEN_MAP_FILE
    if not f.is_file():
        return None
    ids = json.loads(f.read_text())
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"{f}: the token map must be ascending unique ids in [0, {vocab_size})")
    return to_device(ids, "cpu", torch.long)  # at load; moved with the weights


def head_token_map(path: Path, vocab_size: int, given: torch.Tensor | None) -> torch.Tensor | None:
    """A runner's head ids: the folder's token map (a draft trained on it) or ``given`` (a pretrained draft's head
    cut at load, :mod:`spec_core.draft_vocab`), never both; None for the whole vocabulary."""
    folder = load_token_map(path, vocab_size)
    if folder is not None and given is not None:
        raise ValueError(f"{path} has its own token map; a draft head vocabulary cannot be set for it")
    ids = folder if folder is not None else given
    if ids is not None and (ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size
                            or not bool((ids[1:] > ids[:-1]).all())):
        raise ValueError(f"a token map must be ascending unique ids in [0, {vocab_size})")
    return ids


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """The architecture facts the runner needs, read from an HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    qk_norm: bool
    qkv_bias: bool
    tie_embeddings: bool

    @staticmethod
    def from_hf(cfg: PretrainedConfig) -> ArchSpec:
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {cfg.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return ArchSpec(
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_positions=cfg.max_position_embeddings,
            qk_norm=cfg.model_type == "qwen3",
            qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )


def decode_params(cfg: PretrainedConfig) -> int:
    """The weights one decode step reads from an HF config: every layer's matrices and the output layer (the
    embedding is only gathered from). Its ratio between two models is about the ratio of their step costs."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    q, kv = heads * head_dim, (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
    layer = 2 * h * q + 2 * h * kv + 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * layer + cfg.vocab_size * h
