"""Prompt-lookup (n-gram) speculation: propose the tokens that followed the latest earlier occurrence of the
context's last n tokens. Deterministic, so its proposal distribution is one-hot; verified with that q it stays
exact at any temperature (a token is accepted with probability p(x), never by a greedy match)."""

from __future__ import annotations

import torch

from spec_core.transfer import to_device


def propose_ngram(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens continuing the longest (``max_n`` down to ``min_n``) suffix match; [] if none."""
    if k <= 0:
        return []
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


def one_hot_rows(token_ids: list[int], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The proposal distribution of a deterministic speculator: one-hot rows ``[K, V]`` on ``device``."""
    rows = torch.zeros(len(token_ids), vocab_size, device=device)
    if token_ids:
        rows.scatter_(-1, to_device(token_ids, device, torch.long)[:, None], 1.0)
    return rows


def backup_tokens(tokens: list[int], k: int, kind: str) -> list[int]:
    """The fast backup both sides compute identically: ``"ngram"`` (prompt lookup) or ``"none"`` (no draft)."""
    if kind == "ngram":
        return propose_ngram(tokens, k)
    if kind == "none":
        return []
    raise ValueError(f"unknown backup {kind!r}; choose ngram or none")


class NgramIndex:
    """Prompt lookup over a growing token list in O(max_n) per query: the two latest starts of every n-gram
    (n <= ``max_n``). ``propose(ext, k)`` equals ``propose_ngram(tokens + ext, k, max_n)`` for the synced ``tokens``
    (tested), so the drafter can look up every outcome's context (its tokens, a speculative path and a bonus)
    without copying or rescanning the prefix."""

    def __init__(self, max_n: int = 3) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self._starts: dict[tuple[int, ...], tuple[int, int]] = {}

    def sync(self, tokens: list[int]) -> None:
        """Index ``tokens``: an extension of the last ones synced (anything else is indexed from scratch)."""
        old = len(self.tokens)
        if len(tokens) < old or tokens[:old] != self.tokens:
            self._starts, old = {}, 0
        self.tokens = list(tokens)
        for end in range(old, len(tokens)):
            for n in range(1, min(self.max_n, end + 1) + 1):
                gram = tuple(tokens[end - n + 1: end + 1])
                self._starts[gram] = (end - n + 1, self._starts.get(gram, (-1, -1))[0])

    def propose(self, ext: list[int], k: int, min_n: int = 1) -> list[int]:
        """Up to ``k`` tokens continuing the longest (``max_n`` down to ``min_n``) suffix match of ``tokens + ext``;
        [] if none."""
        base, size = len(self.tokens), len(self.tokens) + len(ext)
        if k <= 0:
            return []
        at = lambda i: self.tokens[i] if i < base else ext[i - base]  # noqa: E731
        for n in range(min(self.max_n, size - 1), min_n - 1, -1):
            suffix = [at(i) for i in range(size - n, size)]
            start = next((s for s in range(size - n - 1, max(base - n, -1), -1)
                          if all(at(s + j) == suffix[j] for j in range(n))), None)
            if start is None:
                latest, before = self._starts.get(tuple(suffix), (-1, -1))
                start = latest if 0 <= latest <= size - n - 1 else (before if before >= 0 else None)
            if start is not None and start + n < size:
                return [at(i) for i in range(start + n, min(start + n + k, size))]
        return []
