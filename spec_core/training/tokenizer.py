"""Byte-level BPE tokenizer trained on the corpus, saved in Hugging Face format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from spec_core.training.corpus import EOS_TOKEN


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts``; token id 0 is ``<|endoftext|>`` (EOS, also used as pad)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> np.ndarray:
    """Encode documents into one stream, each followed by EOS. Returns int32 token ids."""
    eos = tokenizer.eos_token_id
    assert eos is not None
    pieces: list[np.ndarray] = []
    batch = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for ids in batch:
        pieces.append(np.asarray(ids + [eos], dtype=np.int32))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
