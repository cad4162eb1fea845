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
