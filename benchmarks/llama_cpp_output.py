"""llama.cpp's own timing lines, parsed: ``llama-speculative-simple``'s summary and ``llama-completion``'s
``llama_perf_context_print`` lines.

A parse never guesses: output without every line it needs, or with numbers that contradict each other, raises
:class:`LlamaCppOutputError` quoting the output's end, so a changed binary fails loudly instead of reporting zeros.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
#: llama.cpp's log prefix when its output is not a terminal: ``0.17.283.614 I `` (time, level)
_PREFIX = r"^(?:[0-9.]+ [A-Z] )?"
_SPEC_PATTERNS = {
    "encoded": rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s",
    "decoded": rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s",
    "n_draft": _PREFIX + r"n_draft\s+=\s+(\d+)\s*$",
    "n_predict": _PREFIX + r"n_predict\s+=\s+(\d+)\s*$",
    "n_drafted": _PREFIX + r"n_drafted\s+=\s+(\d+)\s*$",
    "n_accept": _PREFIX + r"n_accept\s+=\s+(\d+)\s*$",
}
_PERF = r"(?:common_perf_print|llama_perf_context_print):\s+"
_COMPLETION_PATTERNS = {
    "prompt": rf"{_PERF}prompt eval time =\s+{_NUM} ms /\s+(\d+) tokens",
    "eval": rf"{_PERF}eval time =\s+{_NUM} ms /\s+(\d+) runs\s+\(\s*{_NUM} ms per token,\s+{_NUM} tokens per second\)",
}


class LlamaCppOutputError(RuntimeError):
    """llama.cpp's output did not have the lines a parse needs."""


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:]) or "(no output)"


def _matches(text: str, patterns: dict[str, str], what: str) -> dict[str, re.Match]:
    found = {k: list(re.finditer(p, text, re.M)) for k, p in patterns.items()}
    missing = [k for k, m in found.items() if not m]
    if missing:
        raise LlamaCppOutputError(f"cannot parse {what} output: no {', '.join(missing)} line; it ended with:\n"
                                  f"{_tail(text)}")
    return {k: m[-1] for k, m in found.items()}


@dataclass(frozen=True, slots=True)
class SpecTimings:
    """One ``llama-speculative-simple`` run, as it reports itself."""

    prompt_tokens: int
    encode_s: float
    generated: int  #: ``n_predict``: tokens the decode loop emitted
    decode_s: float  #: the decode loop's time (its first step evaluates the prompt's last token)
    decode_tokens_per_s: float  #: llama.cpp's printed speed, ``generated / decode_s``
    n_max: int  #: the draft's maximum length it ran with (``n_draft``)
    drafted: int
    accepted: int

    @property
    def rounds(self) -> int:
        """Target verifications: each emits its accepted draft tokens plus one of its own."""
        return self.generated - self.accepted

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_round(self) -> float:
        return self.generated / self.rounds


def parse_spec_output(text: str) -> SpecTimings:
    """The summary ``llama-speculative-simple`` prints after decoding (``LlamaCppOutputError`` if absent)."""
    m = _matches(text, _SPEC_PATTERNS, "llama-speculative-simple")
    t = SpecTimings(
        prompt_tokens=int(m["encoded"][1]), encode_s=float(m["encoded"][2]), generated=int(m["decoded"][1]),
        decode_s=float(m["decoded"][2]), decode_tokens_per_s=float(m["decoded"][3]), n_max=int(m["n_draft"][1]),
        drafted=int(m["n_drafted"][1]), accepted=int(m["n_accept"][1]))
    if t.generated != int(m["n_predict"][1]) or t.generated <= 0 or t.decode_s <= 0 or t.accepted > t.drafted \
            or t.rounds <= 0:
        raise LlamaCppOutputError(f"llama-speculative-simple's counts contradict each other: {t}; it ended with:\n"
                                  f"{_tail(text)}")
    return t


@dataclass(frozen=True, slots=True)
class CompletionTimings:
    """One ``llama-completion`` run: the prompt's evaluation, then one target step per token after the first."""

    prompt_tokens: int
    prompt_s: float
    eval_runs: int  #: single-token steps: tokens generated after the first
    eval_s: float
    eval_tokens_per_s: float  #: llama.cpp's printed speed, ``eval_runs / eval_s``

    @property
    def generated(self) -> int:
        return self.eval_runs + 1


def parse_completion_output(text: str) -> CompletionTimings:
    """``llama-completion``'s ``llama_perf_context_print`` lines (``LlamaCppOutputError`` if absent)."""
    m = _matches(text, _COMPLETION_PATTERNS, "llama-completion")
    t = CompletionTimings(prompt_tokens=int(m["prompt"][2]), prompt_s=float(m["prompt"][1]) / 1e3,
                          eval_runs=int(m["eval"][2]), eval_s=float(m["eval"][1]) / 1e3,
                          eval_tokens_per_s=float(m["eval"][4]))
    if t.prompt_tokens <= 0 or t.eval_runs <= 0 or t.eval_s <= 0:
        raise LlamaCppOutputError(f"llama-completion's counts are empty: {t}; it ended with:\n{_tail(text)}")
    return t
