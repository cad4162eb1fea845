"""Model loading: any local HF causal-LM folder, tokenizers, vocabulary checks (paths: :mod:`spec_core.model_paths`)."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from spec_core import draft_vocab
from spec_core.arch import TOKEN_MAP_FILE, ArchSpec
from spec_core.config import ModelConfig
from spec_core.model_paths import ModelLoadError, check_model_dir, resolve_model
from spec_core.runner import ModelRunner

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(resolve_model(path, weights=False)))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load tokenizer from {path}: {exc}") from exc


def vocab_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """A stable hash of the token → id map; drafter and verifier must agree on it."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def load_runner(cfg: ModelConfig, reference: bool = True) -> ModelRunner:
    """The runner for ``cfg``; ``reference=False`` for a draft (see :class:`ModelRunner`), whose head may be cut to
    its most frequent tokens (:func:`draft_head_map`)."""
    path = check_model_dir(cfg.path)
    token_map = None if reference else draft_head_map(cfg)
    try:
        return ModelRunner(path, dtype=cfg.torch_dtype, device=cfg.device, weights=cfg.weights, pad_rows=cfg.pad_rows,
                           kernels=cfg.cpu_kernels, reference=reference, token_map=token_map,
                           cuda_graphs=cfg.cuda_graphs)
    except (KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot load weights from {path}: {exc}") from exc


def _head_plan(cfg: ModelConfig) -> tuple[Path, int, int]:
    """A draft's folder, how many frequent ids its head keeps (0: all) and its vocabulary size."""
    folder = resolve_model(cfg.path, weights=False)
    has_map = (folder / TOKEN_MAP_FILE).is_file()
    if has_map or not (folder / "tokenizer_config.json").is_file():
        if cfg.head_vocab:
            raise ModelLoadError(f"a draft head vocabulary needs a draft with its tokenizer and no token map of its "
                                 f"own; {cfg.path} has {'a token map' if has_map else 'no tokenizer'}")
        return folder, 0, 0
    vocab_size = ArchSpec.from_hf(AutoConfig.from_pretrained(str(folder))).vocab_size
    return folder, draft_vocab.resolve_head_vocab(cfg.head_vocab, vocab_size), vocab_size


def draft_head_vocab(cfg: ModelConfig) -> int:
    """How many of the most frequent token ids a draft's head keeps (0: its whole vocabulary, also for a draft
    trained on a token map of its own, or one without a tokenizer to count with; :mod:`spec_core.draft_vocab`)."""
    return _head_plan(cfg)[1]


def draft_head_map(cfg: ModelConfig) -> torch.Tensor | None:
    """The token ids a draft's head keeps (:func:`draft_head_vocab` of them and the special ones), or None for its
    whole vocabulary."""
    folder, n, vocab_size = _head_plan(cfg)
    if not n:
        return None
    tokenizer = load_tokenizer(folder)
    return draft_vocab.draft_token_map(tokenizer, vocab_hash(tokenizer), n, vocab_size)


def eos_token_ids(runner: ModelRunner, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Every EOS id: the model config's and generation_config's (either may be a list) plus the tokenizer's."""
    ids: set[int] = set()
    gen_file = Path(runner.path) / "generation_config.json"
    gen_eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
    for cfg_eos in (getattr(runner.hf_config, "eos_token_id", None), gen_eos):
        if isinstance(cfg_eos, int):
            ids.add(cfg_eos)
        elif isinstance(cfg_eos, (list, tuple)):
            ids.update(int(i) for i in cfg_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


@dataclass(slots=True)
class LoadedPair:
    """A target (and optional draft) runner with their shared tokenizer."""

    target: ModelRunner
    draft: ModelRunner | None
    tokenizer: PreTrainedTokenizerBase
    eos_ids: tuple[int, ...]


def check_vocab(target: ModelRunner, draft: ModelRunner, t_tok: PreTrainedTokenizerBase,
                d_tok: PreTrainedTokenizerBase) -> None:
    if target.vocab_size != draft.vocab_size:
        raise ModelLoadError(
            f"target and draft vocabularies differ: target has {target.vocab_size} tokens, draft {draft.vocab_size}"
        )
    if vocab_hash(t_tok) != vocab_hash(d_tok):
        raise ModelLoadError("target and draft tokenizers differ (different token → id maps)")


def load_pair(target: ModelConfig, draft: ModelConfig | None) -> LoadedPair:
    """Load the target (and draft) runners and the tokenizer, checking they share a vocabulary."""
    check_model_dir(target.path)
    if draft is not None:
        check_model_dir(draft.path)
    tokenizer = load_tokenizer(target.path)
    t_runner = load_runner(target)
    d_runner = None
    if draft is not None:
        d_runner = load_runner(draft, reference=False)
        d_dir = resolve_model(draft.path, weights=False)
        d_tok = load_tokenizer(d_dir) if (d_dir / "tokenizer_config.json").exists() else tokenizer
        check_vocab(t_runner, d_runner, tokenizer, d_tok)
    logger.info("loaded target %s (%s)%s", target.path, target.dtype, f" and draft {draft.path}" if draft else "")
    return LoadedPair(t_runner, d_runner, tokenizer, eos_token_ids(t_runner, tokenizer))


def set_threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)
