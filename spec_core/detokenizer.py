"""Incremental, UTF-8-safe detokenisation and stop-string matching.

Byte-level BPE tokens can split a multi-byte character; decoding such a prefix yields U+FFFD. A delta is released
only once the decoded text no longer ends in U+FFFD, so streamed deltas never contain broken characters and their
concatenation equals the full decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: object
    ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a request, release whatever is held back (it may end in U+FFFD)."""
        full = self._decode(self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index where the earliest stop string begins at or after ``search_from`` (the start of the unchecked
    region minus the longest stop's length, so matches spanning token boundaries are found), else None."""
    best: int | None = None
    for s in stops:
        idx = text.find(s, max(0, search_from))
        if idx >= 0 and (best is None or idx < best):
            best = idx
    return best
