"""Typed messages between the verifier and the SSD drafter (the transport-neutral protocol).

Round numbering: round R verifies speculation S_R. After round R the verifier sends an :class:`OutcomeEvent`
(accepted tokens and the bonus). The drafter pre-builds, *while* round R is verified, a :class:`BranchBundle` for
round R: one speculation per likely outcome key ``(k accepted, bonus token)``. If the outcome's key is in the
bundle that arrived before round R's verification returned, S_{R+1} is that branch (a cache hit); otherwise the
drafter drafts S_{R+1} just in time (:class:`SpeculationMsg`) or the verifier uses a backup.

Every speculation carries the exact distribution each token was sampled from (``draft_probs``, None for greedy
requests), so the verifier never recomputes q.

Candidate trees: a speculation may be a token tree (``parents``; None is a chain). Its first nodes are the *spine*,
a chain (node i's parent is i - 1); the rest hang off it. An outcome is keyed by ``(slot, bonus)``: slot 0 is the
root (nothing accepted) and slot ``i + 1`` node i (the last accepted node). On a chain the slot of k accepted tokens
is k, so chain keys are the paper's ``(k, bonus)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from spec_core.config import SamplingParams, lookup_depth


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def node_depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for par in parents:
        out.append(1 if par < 0 else out[par] + 1)
    return out


def slot_positions(n: int, tree_parents: list[int]) -> list[int]:
    """The position of the token each outcome slot picks, for a tree after ``n`` tokens: slot 0 (the root) the one
    at n, node i's slot the one at n + its depth."""
    return [n] + [n + d for d in node_depths(tree_parents)]


def spine_length(parents: list[int] | None, n: int) -> int:
    """How many leading nodes form a chain from the root (all ``n`` when ``parents`` is None)."""
    if parents is None:
        return n
    s = 0
    while s < len(parents) and parents[s] == s - 1:
        s += 1
    return s


def path_nodes(parents: list[int] | None, slot: int) -> list[int]:
    """The node indices from the root to outcome slot ``slot`` (slot 0: none; slot i + 1: through node i)."""
    if parents is None:
        return list(range(slot))
    path, i = [], slot - 1
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def spine_tree(spine: list[int], leaves: list[list[int]]) -> tuple[list[int], list[int] | None]:
    """(tokens, parents) of a spine with leaves: ``leaves[d]`` sit beside spine node d (same parent, d - 1).
    Spine nodes come first, then the leaves by depth; parents is None when there are no leaves (a chain)."""
    tokens, parents = list(spine), chain_parents(len(spine))
    for d, extra in enumerate(leaves[: len(spine)]):
        tokens.extend(extra)
        parents.extend([d - 1] * len(extra))
    return tokens, (parents if len(tokens) > len(spine) else None)


@dataclass(frozen=True, slots=True)
class Speculation:
    """Proposed tokens following a known root token: a chain (``parents`` None) or a tree whose leading nodes are
    its spine (module docstring); ``draft_probs [N, V]`` (row i: node i's distribution) or None (greedy)."""

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    source: str = "cache"
    parents: list[int] | None = None
    #: The first node of the tree's prompt-lookup branch (its nodes are the last ones; None: no such branch): it may
    #: reach deeper than the spine (:func:`spec_core.config.lookup_depth`), and the drafter measures it apart.
    lookup_from: int | None = None

    def __post_init__(self) -> None:
        if self.parents is not None:
            if len(self.parents) != len(self.token_ids):
                raise ValueError(f"{len(self.parents)} parents for {len(self.token_ids)} tokens")
            if any(not -1 <= p < i for i, p in enumerate(self.parents)):
                raise ValueError("a tree's parents must come before their children (-1 is the root)")

    @property
    def k(self) -> int:
        """The spine's length: the lookahead this speculation was drafted for."""
        return spine_length(self.parents, len(self.token_ids))

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def tree_parents(self) -> list[int]:
        return self.parents if self.parents is not None else chain_parents(len(self.token_ids))

    def truncated(self, k: int, max_nodes: int | None = None) -> Speculation:
        """The nodes a verifier at lookahead ``k`` keeps (a speculation drafted for a longer one, used at ``k``):
        depth <= ``k``, and <= :func:`lookup_depth` ``(k)`` on the prompt-lookup branch; of those the first
        ``max_nodes`` (a prefix of a topologically ordered tree is a tree: the verifier's node budget)."""
        if self.parents is None:
            k = min(k, max_nodes) if max_nodes is not None else k
            if k >= len(self.token_ids):
                return self
            return Speculation(self.token_ids[:k], None if self.draft_probs is None else self.draft_probs[:k],
                               self.source)
        depth = node_depths(self.parents)
        first = len(depth) if self.lookup_from is None else self.lookup_from
        keep = [i for i, d in enumerate(depth) if d <= (k if i < first else lookup_depth(k))][:max_nodes]
        if len(keep) == len(self.token_ids):
            return self
        new = {old: j for j, old in enumerate(keep)}
        probs = None if self.draft_probs is None else self.draft_probs[keep]
        lookup = sum(1 for i in keep if i < first)
        return Speculation([self.token_ids[i] for i in keep], probs, self.source,
                           [new[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
                           lookup if lookup < len(keep) else None)


@dataclass(frozen=True, slots=True)
class PrefillEvent:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    k: int


@dataclass(frozen=True, slots=True)
class OutcomeEvent:
    """The verification outcome of ``round``: of the ``verified`` speculation, ``num_accepted`` tokens were
    accepted, then ``bonus`` was sampled. ``next_k`` is the lookahead the verifier will use next round and
    ``verify_s`` its current verify time, so the drafter can tell whether a just-in-time draft would be in time.
    The drafter's branches apply only if ``verified`` is the speculation they were built on.
    """

    request_id: str
    round: int
    verified: list[int]
    num_accepted: int
    bonus: int
    next_k: int
    verify_s: float = 0.0
    sent_at: float = 0.0
    #: False when the verifier will not wait for a just-in-time draft on a miss (its backup policy chose the fast
    #: backup): the drafter then builds straight on the backup speculation.
    jit: bool = True
    #: A tree's parents (None: ``verified`` is a chain) and the outcome slot of the last accepted node (None: the
    #: chain slot, ``num_accepted``).
    parents: list[int] | None = None
    slot: int | None = None
    #: The verifier's measured cost of one more tree node, as a fraction of its current verify (None: unknown).
    node_cost: float | None = None
    #: Its step seconds by step size (``step_s[i]``: i + 1 tokens; None: not yet measured), and the tokens of the
    #: other requests in its last step, for the drafter's ``--tree auto`` (``StepTimes``).
    step_s: list[float] | None = None
    step_others: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.num_accepted if self.slot is None else self.slot, self.bonus)

    @property
    def path(self) -> list[int]:
        return path_nodes(self.parents, self.key[0])

    @property
    def accepted(self) -> list[int]:
        return [self.verified[i] for i in self.path]

    @property
    def spine_accepted(self) -> int:
        """How many accepted nodes lie on the spine (their K/V sits at its true positions on the drafter)."""
        path = self.path
        return next((j for j, i in enumerate(path) if i != j), len(path))


@dataclass(frozen=True, slots=True)
class FreeEvent:
    request_id: str


@dataclass(frozen=True, slots=True)
class SpeculationMsg:
    """A just-in-time speculation for ``round`` (after a miss)."""

    request_id: str
    round: int
    speculation: Speculation


@dataclass(slots=True)
class ChainMsg:
    """Run-ahead drafting: the drafter's chain for a request from absolute position ``start`` on, drafted after it
    had applied the outcome of ``round`` (-1: only the prompt); it continues the request's tokens before ``start``
    as the drafter knew them then. ``busy_s``: the drafter's total forward seconds so far."""

    request_id: str
    round: int
    start: int
    speculation: Speculation
    busy_s: float = 0.0


@dataclass(slots=True)
class BranchBundle:
    """Pre-drafted speculations for the outcomes of ``round``, keyed by ``(k, bonus)``, built assuming round
    ``round`` verifies ``base_tokens``."""

    request_id: str
    round: int
    base_tokens: list[int]
    #: A dict where built; a received bundle's builds each branch on first use (``protos.codec.ReceivedBranches``).
    entries: Mapping[tuple[int, int], Speculation] = field(default_factory=dict)
    ready_at: float = 0.0
    #: The parents of the verified tree (None: ``base_tokens`` is a chain).
    base_parents: list[int] | None = None


@runtime_checkable
class DrafterLink(Protocol):
    """The verifier's end of a drafter connection: the interface every transport implements (the gRPC stream,
    the local process pipe, the in-process loopback), carrying the codec's messages.

    Events (:class:`PrefillEvent`, :class:`OutcomeEvent`, :class:`FreeEvent`) go to the drafter; speculations
    (:class:`BranchBundle`, :class:`SpeculationMsg`) come back. ``send`` never blocks; ``flush`` delivers what a
    batching transport holds (called after proposing, before the verify); ``alive`` turns False once the drafter
    is gone, after which ``poll`` only drains what already arrived.
    """

    @property
    def alive(self) -> bool: ...

    def send(self, msg: object) -> None: ...

    def poll(self, timeout: float | None = 0.0) -> bool: ...

    def recv(self) -> object: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...
