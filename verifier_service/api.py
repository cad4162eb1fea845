"""The in-process generation API used by the CLI, the benchmarks and the tests.

Every mode runs through the one :class:`verifier_service.engine.VerifierEngine`: AR with no proposer, SD with the
in-process draft engine (:class:`spec_core.draft_engine.BatchDrafter`); SSD (a drafter in its own process) is
:mod:`cluster.local_ssd`, on the same engine. The engines are built once per (mode, K) and reused.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from spec_core import chat
from spec_core.config import MODES, ModelConfig, SamplingParams
from spec_core.draft_engine import BatchDrafter, DraftConfig
from spec_core.metrics import DecodeStats
from spec_core.models import LoadedPair, load_pair
from spec_core.sequence import Sequence
from verifier_service.engine import VerifierEngine
from verifier_service.engine_builder import blocks_for_one, build_engine, plan_for_one

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
            out.update(s.rounds_json())
        return out


#: The engine's name in bench rows and result JSON (``runtime``): every mode of this package runs on it.
RUNTIME = "verifier-engine"


def engine_for_one(target, drafter: BatchDrafter | None, k: int, block_size: int = 16,
                   adaptive_k: bool = False) -> VerifierEngine:
    """A batch-1 engine whose KV pool holds one request of the model's full context (and its speculation)."""
    return build_engine(target, plan_for_one(target, k, block_size, adaptive_k), drafter)


class Generator:
    """Loads a target (and draft) once and serves single requests in AR or SD mode, on the verifier engine.

    ``adaptive``: SD chooses K per step from measured costs, up to K and down to 0 (one planner per engine, kept
    across requests), as ``ssd serve`` does; otherwise it drafts K tokens every round."""

    def __init__(self, target: ModelConfig, draft: ModelConfig | None, k: int = 5, adaptive: bool = False) -> None:
        self.pair: LoadedPair = load_pair(target, draft)
        self.k = k
        self.adaptive = adaptive
        self._engines: dict[tuple[str, int], VerifierEngine] = {}

    @classmethod
    def from_pair(cls, pair: LoadedPair, k: int = 5, adaptive: bool = False) -> Generator:
        """A generator over an already loaded pair."""
        gen = cls.__new__(cls)
        gen.pair, gen.k, gen.adaptive, gen._engines = pair, k, adaptive, {}
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

    def engine(self, mode: str, k: int) -> VerifierEngine:
        """The (cached) engine for ``mode`` at ``k`` draft tokens per round."""
        key = (mode, k if mode == "sd" else 0)
        if key not in self._engines:
            drafter = None
            if mode == "sd":
                draft = self.pair.draft
                drafter = BatchDrafter(draft, DraftConfig(k=k, num_blocks=blocks_for_one(draft, k), block_size=16))
            self._engines[key] = engine_for_one(self.pair.target, drafter, key[1], adaptive_k=self.adaptive)
        return self._engines[key]

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
        if mode == "sd" and self.pair.draft is None:
            raise ValueError("mode 'sd' needs a draft model (--draft)")
        ids = chat.encode(self.pair.tokenizer, prompt)
        self.check_token_ids(ids)
        seq = Sequence(request_id, ids, params, eos_ids=self.pair.eos_ids, max_len=self.pair.target.spec.max_positions)
        stats = run_one(self.engine(mode, self.k if k is None else k), seq)
        return GenerationResult(
            mode=mode,
            prompt_token_ids=ids,
            token_ids=list(seq.output_ids),
            text=chat.decode(self.pair.tokenizer, seq.output_ids),
            finish_reason=seq.finish_reason,
            stats=stats,
            ttft_s=stats.prefill_s,
            emit_times=list(seq.emit_times),
        )


def run_one(engine: VerifierEngine, seq: Sequence) -> DecodeStats:
    """Run one request alone through an idle ``engine``; its stats with prefill and decode times filled in."""
    t0 = time.perf_counter()
    engine.add(seq)
    engine.run()
    stats = seq.stats
    stats.num_generated = len(seq.output_ids)
    stats.prefill_s = seq.emit_times[0] - t0
    stats.decode_s = seq.emit_times[-1] - seq.emit_times[0]
    return stats
