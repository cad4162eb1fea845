"""What a user would run instead: transformers ``generate`` of the target, and its assisted generation.

Decode time is measured with a streamer that timestamps every chunk transformers emits: from the first generated
token to the last, so prefill and model load are excluded exactly as in our own modes.
"""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from spec_core.config import SamplingParams
from spec_core.metrics import DecodeStats


class _Clock(BaseStreamer):
    """Records the time of every ``put`` (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


class HFGenerate:
    """transformers ``generate`` on the target; ``assistant`` turns on assisted generation with the draft."""

    def __init__(self, target_path: str, draft_path: str | None = None, num_assistant_tokens: int | None = None):
        self.model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
        self.assistant = (AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()
                          if draft_path else None)
        if num_assistant_tokens is not None:
            self.set_assistant_tokens(num_assistant_tokens)

    def set_assistant_tokens(self, n: int) -> None:
        """A constant number of draft tokens per round (transformers' default is a heuristic schedule from 20)."""
        if self.assistant is not None:
            self.assistant.generation_config.num_assistant_tokens = n
            self.assistant.generation_config.num_assistant_tokens_schedule = "constant"

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], DecodeStats, float]:
        ids = torch.tensor([prompt_ids])
        clock = _Clock()
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=params.max_new_tokens, streamer=clock,
                      do_sample=not params.greedy, pad_token_id=self.model.config.eos_token_id)
        if params.ignore_eos:
            kwargs["min_new_tokens"] = params.max_new_tokens
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        t0 = time.perf_counter()
        out = self.model.generate(ids, **kwargs)[0, len(prompt_ids):].tolist()
        stats = DecodeStats(num_generated=len(out))
        first = clock.times[1] if len(clock.times) > 1 else t0
        stats.prefill_s = first - t0
        stats.decode_s = clock.times[-1] - first
        stats.num_rounds = max(0, len(clock.times) - 2)
        stats.num_round_tokens = max(0, len(out) - 1)
        return out, stats, stats.prefill_s
