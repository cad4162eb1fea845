"""Per-request (or summed) decoding counters, and the one place the derived rates are computed.

Definitions (every benchmark, service stat and result JSON uses these):
  * a *round* is one target forward after the prompt's (the prefill forward emits the first token, not a round);
  * tokens per round = tokens emitted by rounds ÷ rounds (AR: 1.0; a round emits its accepted tokens and one more,
    fewer when the request stops inside it);
  * acceptance rate = accepted draft tokens ÷ drafted tokens;
  * a *draft* is a round that proposed at least one token (vLLM's ``num_drafts``): drafts ≤ rounds;
  * decode tokens/s = (generated − 1) ÷ decode time (from the first token to the last).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def ratio(num: float, den: float) -> float | None:
    """``num / den``, or None when there is nothing to divide by."""
    return num / den if den else None


_SUMMED = ("num_generated", "num_rounds", "num_round_tokens", "num_drafted", "num_accepted", "num_drafts", "prefill_s",
           "decode_s", "verify_s", "draft_s")


@dataclass(slots=True)
class DecodeStats:
    """Counters for one request (or summed over many with :meth:`merge`)."""

    num_generated: int = 0
    num_rounds: int = 0
    num_round_tokens: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_drafts: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    verify_s: float = 0.0
    draft_s: float = 0.0

    @property
    def mean_tokens_per_round(self) -> float | None:
        return ratio(self.num_round_tokens, self.num_rounds)

    @property
    def plain_round_fraction(self) -> float | None:
        """Rounds that proposed nothing (planned K = 0, or a miss with no backup match), of all rounds."""
        return ratio(self.num_rounds - self.num_drafts, self.num_rounds)

    @property
    def acceptance_rate(self) -> float | None:
        return ratio(self.num_accepted, self.num_drafted)

    @property
    def tokens_per_s(self) -> float | None:
        return (self.num_generated - 1) / self.decode_s if self.decode_s > 0 else None

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def record_round(self, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        """One round: ``num_draft`` tokens proposed (tree depth), ``num_accepted`` accepted, ``num_emitted`` kept."""
        self.num_rounds += 1
        self.num_round_tokens += num_emitted
        self.num_drafted += num_draft
        self.num_accepted += num_accepted
        self.num_drafts += int(num_draft > 0)
        self._grow(num_draft)
        for j in range(num_draft):
            self.drafted_by_position[j] += 1
            self.accepted_by_position[j] += int(j < num_accepted)

    def _grow(self, n: int) -> None:
        while len(self.drafted_by_position) < n:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)

    def merge(self, other: DecodeStats) -> None:
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._grow(len(other.drafted_by_position))
        for j, (a, d) in enumerate(zip(other.accepted_by_position, other.drafted_by_position)):
            self.accepted_by_position[j] += a
            self.drafted_by_position[j] += d

    def since(self, before: DecodeStats) -> DecodeStats:
        """The counters accumulated after the snapshot ``before`` (a copy taken earlier with :meth:`copy`)."""
        out = DecodeStats()
        for name in _SUMMED:
            setattr(out, name, getattr(self, name) - getattr(before, name))
        out._grow(len(self.drafted_by_position))
        for j, (a, d) in enumerate(zip(self.accepted_by_position, self.drafted_by_position)):
            b_a = before.accepted_by_position[j] if j < len(before.accepted_by_position) else 0
            b_d = before.drafted_by_position[j] if j < len(before.drafted_by_position) else 0
            out.accepted_by_position[j], out.drafted_by_position[j] = a - b_a, d - b_d
        return out

    def copy(self) -> DecodeStats:
        return DecodeStats(**{f: getattr(self, f) for f in self.__slots__ if not f.startswith("_")}
                           | {"accepted_by_position": list(self.accepted_by_position),
                              "drafted_by_position": list(self.drafted_by_position)})

    def rounds_json(self) -> dict:
        """The speculation fields of every result JSON."""
        return {"num_rounds": self.num_rounds, "mean_tokens_per_round": self.mean_tokens_per_round,
                "acceptance_rate": self.acceptance_rate, "acceptance_by_position": self.acceptance_by_position()}
