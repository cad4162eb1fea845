"""The in-process generation API used by the CLI, the benchmarks and the tests."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from spec_core import chat
from spec_core.config import MODES, ModelConfig, SamplingParams
from spec_core.decoding import DecodeStats, generate_ar, generate_sd
from spec_core.models import LoadedPair, load_pair
from spec_core.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerationResult:
    """One finished request, with the JSON fields of ``ssd generate --json``."""

    mode: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: DecodeStats
    ttft_s: float
    emit_times: list[float]

    def to_json(self) -> dict:
        s = self.stats
        out = {
            "mode": self.mode,
            "text": self.text,
            "token_ids": self.token_ids,
            "num_generated": len(self.token_ids),
            "num_prompt_tokens": len(self.prompt_token_ids),
            "finish_reason": self.finish_reason,
            "tokens_per_s": s.tokens_per_s,
            "ttft_s": self.ttft_s,
            "decode_s": s.decode_s,
        }
        if self.mode != "ar":
            out.update(
                num_rounds=s.num_rounds,
                mean_tokens_per_round=s.mean_tokens_per_round,
                acceptance_rate=s.acceptance_rate,
                acceptance_by_position=s.acceptance_by_position(),
            )
        return out


class Generator:
    """Loads a target (and draft) once and serves single requests in AR or SD mode."""

    def __init__(self, target: ModelConfig, draft: ModelConfig | None, k: int = 5) -> None:
        self.pair: LoadedPair = load_pair(target, draft)
        self.k = k

    @classmethod
    def from_pair(cls, pair: LoadedPair, k: int = 5) -> Generator:
        """A generator over an already loaded pair."""
        gen = cls.__new__(cls)
        gen.pair, gen.k = pair, k
        return gen

    @property
    def tokenizer(self):
        return self.pair.tokenizer

    def encode(self, prompt: str) -> list[int]:
        return chat.encode_prompt(self.pair.tokenizer, prompt)

    def check_token_ids(self, ids: list[int]) -> None:
        vocab = self.pair.target.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids out of vocabulary (size {vocab}): {bad[:5]}")

    def generate(
        self,
        prompt: chat.Prompt,
        params: SamplingParams,
        mode: str = "sd",
        k: int | None = None,
        request_id: str = "0",
    ) -> GenerationResult:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode == "ssd":
            raise ValueError("mode 'ssd' runs the drafter in its own process: use cluster.local_ssd "
                             "(what `ssd generate --mode ssd` does)")
        ids = chat.encode(self.pair.tokenizer, prompt)
        self.check_token_ids(ids)
        target = self.pair.target
        seq = Sequence(request_id, ids, params, eos_ids=self.pair.eos_ids, max_len=target.spec.max_positions)
        if mode == "ar":
            stats = generate_ar(target, seq)
        else:
            if self.pair.draft is None:
                raise ValueError("mode 'sd' needs a draft model (--draft)")
            stats = generate_sd(target, self.pair.draft, seq, self.k if k is None else k)
        text = chat.decode(self.pair.tokenizer, seq.output_ids)
        return GenerationResult(
            mode=mode,
            prompt_token_ids=ids,
            token_ids=list(seq.output_ids),
            text=text,
            finish_reason=seq.finish_reason,
            stats=stats,
            ttft_s=stats.prefill_s,
            emit_times=list(seq.emit_times),
        )
