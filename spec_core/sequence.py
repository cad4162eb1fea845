"""Per-request state: one object holds a request's tokens, sampling settings, randomness and stop logic."""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass, field

import torch

from spec_core.config import SamplingParams
from spec_core.detokenizer import IncrementalDetokenizer, find_stop
from spec_core.metrics import DecodeStats

#: ``purpose`` keys of :meth:`Sequence.uniforms_at`: draft tokens, and the verification of a round.
DRAFT, VERIFY, DRAFT_LEAF = 1, 2, 3
_UNIT = 2.0**-24  # a 24-bit integer times this is a float32 uniform in [0, 1)


@dataclass(slots=True, eq=False)
class Sequence:
    """A request's tokens and progress. Two sequences are equal only if they are the same object (a request is an
    identity, not its field values; field-wise ``==`` also made the scheduler's membership tests O(fields)).

    Invariants: ``output_ids`` only grows, and only through :meth:`append`, which applies the stop rules (stop ids,
    EOS unless ``ignore_eos``, ``max_new_tokens``, the context limit). The token that triggers a stop is kept, as
    transformers does. ``emit_times`` has one timestamp per output token.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...] = ()
    max_len: int = 1 << 30
    output_ids: list[int] = field(default_factory=list)
    emit_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator = field(default_factory=torch.Generator)
    #: Incremental text, needed for stop strings and streaming (None: token ids only).
    detokenizer: IncrementalDetokenizer | None = None
    #: Tokens whose K/V is committed in the target cache (engine bookkeeping).
    num_computed: int = 0
    #: Tokens whose K/V is valid in the in-process draft engine's cache (SD; see spec_core.draft_engine).
    num_draft_computed: int = 0
    #: Text cut at a stop string (None while no stop string matched).
    stopped_text: str | None = None
    #: The target's log-probability of each output token (filled only when ``params.logprobs``).
    output_logprobs: list[float] = field(default_factory=list)
    #: The ``params.top_logprobs`` most likely (token id, log-probability) pairs of each position, best first.
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    #: This request's decoding counters (rounds, acceptance, times), kept by the engine that runs it.
    stats: DecodeStats = field(default_factory=DecodeStats)
    #: Draft tokens planned for its next round by the adaptive-K policy (None: the engine's K).
    planned_k: int | None = None
    #: The seed of this request's draws (``params.seed``, or a random one): the key of :meth:`uniforms_at`.
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt is empty")
        if len(self.prompt_ids) >= self.max_len:
            raise ValueError(f"prompt has {len(self.prompt_ids)} tokens; the context limit is {self.max_len}")
        seed = self.params.seed if self.params.seed is not None else torch.seed() % (1 << 63)
        self.generator.manual_seed(seed)
        self.seed = seed

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        """Tokens that may still be generated (by the budget and the context)."""
        return min(self.params.max_new_tokens - len(self.output_ids), self.max_len - self.num_tokens)

    def stop_ids(self) -> set[int]:
        ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids.update(self.eos_ids)
        return ids

    def append(self, tokens: list[int], logprobs: list[float] | None = None,
               top: list[list[tuple[int, float]]] | None = None) -> list[int]:
        """Append tokens (and their logprobs and alternatives) until a stop rule fires; returns the tokens actually
        appended."""
        now = time.perf_counter()
        stops = self.stop_ids()
        taken: list[int] = []
        for i, tok in enumerate(tokens):
            if self.finished:
                break
            if logprobs is not None:
                self.output_logprobs.append(logprobs[i])
            if top is not None:
                self.output_top_logprobs.append(top[i])
            self.output_ids.append(tok)
            self.emit_times.append(now)
            taken.append(tok)
            if self._hit_stop_string(tok):
                self.finish_reason = "stop"
            elif tok in stops:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_new_tokens or self.num_tokens >= self.max_len:
                self.finish_reason = "length"
        return taken

    def _hit_stop_string(self, tok: int) -> bool:
        if self.detokenizer is None:
            return False
        before = len(self.detokenizer.text)
        self.detokenizer.push(tok)
        if not self.params.stop:
            return False
        longest = max(len(s) for s in self.params.stop)
        idx = find_stop(self.detokenizer.text, self.params.stop, before - longest + 1)
        if idx is None:
            return False
        self.stopped_text = self.detokenizer.text[:idx]
        return True

    @property
    def text(self) -> str:
        """The output text: cut before a matched stop string, else everything decoded so far."""
        if self.stopped_text is not None:
            return self.stopped_text
        if self.detokenizer is None:
            return ""
        if self.finished:
            self.detokenizer.flush()
        return self.detokenizer.text

    def uniforms(self, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self.generator)

    def uniforms_at(self, position: int, n: int, purpose: int) -> torch.Tensor:
        """``n`` uniforms in [0, 1) keyed by (seed, ``purpose``, ``position``): a counter-based draw (keyed
        BLAKE2b, below), the same whenever it is asked again, independent across keys. Draft tokens at a position
        and the verification of a round rooted at a position use them, so a sampled request's tokens do not depend
        on which round, batch or timing produced them (with a fixed K and no n-gram backup: :attr:`reproducible`).

        The draw is keyed BLAKE2b (a pseudorandom function of its key): block i of 64 bytes is the hash of i under
        the key (seed, purpose << 40 | position), and each 32-bit word's top 24 bits make one uniform, exact in
        float32. It costs about a third of constructing a numpy Philox generator for each call, which it replaced:
        one to three calls a round for every request."""
        return self.uniforms_for([position], n, purpose)

    def uniforms_for(self, positions: list[int], n: int, purpose: int) -> torch.Tensor:
        """``uniforms_at(p, n, purpose)`` for every p in ``positions``, concatenated, as one tensor."""
        return torch.tensor([u for p in positions for u in self._uniform_values(p, n, purpose)], dtype=torch.float32)

    def _uniform_values(self, position: int, n: int, purpose: int) -> list[float]:
        key = struct.pack("<QQ", self.seed % (1 << 64), (purpose << 40) | position)
        data = b"".join(hashlib.blake2b(struct.pack("<I", i), digest_size=64, key=key).digest()
                        for i in range(-(-n // 16)))
        return [(w >> 8) * _UNIT for w in struct.unpack_from(f"<{n}I", data)]

    @property
    def reproducible(self) -> bool:
        """A seeded sampled request under the residual rule: its engine keeps K fixed and waits for neural drafts
        instead of the n-gram backup, so the same seed gives the same tokens (greedy and coupled requests are
        deterministic anyway)."""
        return self.params.seed is not None and not self.params.deterministic
