"""Candidate trees for SSD's speculations: the leaves beside a spine, a tree grown level by level, its prompt-lookup
branch, and how many leaves and lookup nodes ``--tree auto`` keeps (:class:`spec_core.config.TreeShape`). Pure
functions over logits and rates."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spec_core.config import lookup_depth
from spec_core.estimators import RateEstimator
from spec_core.fanout import FanoutConfig, fanout_for, tree_fanout
from spec_core.ngram import NgramIndex
from spec_core.select import topk_rows
from spec_core.speculation import Speculation, chain_parents, node_depths, path_nodes, spine_tree
from spec_core.transfer import to_host


def bonus_candidates(ranked_rows: list[list[int]], parents: list[int], tokens: list[int],
                     guesses: list[int | None]) -> list[list[int]]:
    """The candidate bonus tokens at every outcome slot of a speculation (``parents``, ``tokens``), best first:
    prompt lookup's guess (``guesses[j]``, None for none), then the draft's ranking ``ranked_rows[j]``, without the
    slot's own children (after a rejection there the bonus is never one of them under greedy decoding). Lookup
    goes first because, where the draft's top token is rejected, it names the target's token more often than the
    draft's next two choices together (HumanEval: 58% against 31%)."""
    children: list[set[int]] = [set() for _ in ranked_rows]
    for par, tok in zip(parents, tokens):
        children[par + 1].add(tok)
    out = []
    for j, ranked in enumerate(ranked_rows):
        guess = guesses[j]
        first = [guess] if guess is not None and guess not in children[j] else []
        out.append(first + [t for t in ranked if t not in children[j] and t not in first])
    return out


def slot_fanout(config: FanoutConfig, s: Speculation, a: float, r: float, rho: float, lookup_end: list[float]
                ) -> list[int]:
    """F per outcome slot of ``s`` (its root, then every node): the spine's schedule, plus its leaves' and its
    lookup branch's (:func:`spec_core.fanout.tree_fanout`; ``lookup_end[m]``: P(a round ends on lookup node m))."""
    if s.parents is None:
        return fanout_for(config, s.k, a, r)
    depth = node_depths(s.parents)
    end = s.num_nodes if s.lookup_from is None else s.lookup_from  # leaves, then the lookup branch
    leaves = [0] * s.k
    for i in range(s.k, end):
        leaves[depth[i] - 1] += 1
    return tree_fanout(config, s.k, leaves, a, r, rho, lookup_end[: s.num_nodes - end])


def slot_guesses(index: NgramIndex, s: Speculation) -> list[int | None]:
    """Prompt lookup's guess at the bonus after every outcome slot of ``s`` (its root, then each node), over the
    context ``index`` holds followed by the slot's path."""
    out = []
    for j in range(s.num_nodes + 1):
        nxt = index.propose([s.token_ids[p] for p in path_nodes(s.parents, j)], 1)
        out.append(nxt[0] if nxt else None)
    return out


def leaf_tokens(logits: torch.Tensor, spine: list[int], extra: int) -> list[list[int]]:
    """For each row of ``logits [m, V]``, its ``extra`` likeliest tokens other than the row's spine token (the
    leaves beside it; excluding it explicitly keeps them distinct when logits tie)."""
    top = to_host(topk_rows(logits, extra + 1)[1])
    return [[t for t in row if t != tok][:extra] for row, tok in zip(top, spine)]


@dataclass(slots=True)
class GrowingTree:
    """One speculation being drafted level by level: the spine's tokens and q rows, and the leaves beside each
    spine node with theirs (a sampled leaf's row is its spine node's: siblings are i.i.d. draws from one q)."""

    spine: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    leaves: list[list[int]] = field(default_factory=list)
    leaf_q: list[torch.Tensor] = field(default_factory=list)

    def add(self, token: int, q_row: torch.Tensor | None, leaves: list[int], leaf_q: torch.Tensor | None) -> None:
        self.spine.append(token)
        self.leaves.append(leaves)
        if q_row is not None:
            self.q.append(q_row)
            if leaf_q is not None:
                self.leaf_q.append(leaf_q)

    def speculation(self, source: str = "cache", lookup: list[int] | None = None, max_lookup: int = 0
                    ) -> Speculation:
        """The tree: spine, leaves by depth, then (greedy only) up to ``max_lookup`` nodes of the prompt-lookup
        proposal ``lookup``: the part past its common prefix with the spine, hung from the spine node where they
        part, to :func:`spec_core.config.lookup_depth`. A leaf with the branch's first token is dropped (the branch node replaces it)."""
        d = 0
        lookup = lookup or []
        while d < min(len(lookup), len(self.spine)) and lookup[d] == self.spine[d]:
            d += 1
        rest = lookup[d: lookup_depth(len(self.spine))][:max_lookup] if d < len(self.spine) else []
        if rest and self.q:
            raise ValueError("prompt-lookup branches are for greedy trees only")
        leaves = [[t for t in side if not (rest and depth == d and t == rest[0])]
                  for depth, side in enumerate(self.leaves)]
        tokens, parents = spine_tree(self.spine, leaves)
        probs = torch.cat([torch.stack(self.q), *self.leaf_q]) if self.q else None
        if not rest:
            return Speculation(tokens, probs, source, parents)
        start = len(tokens)
        parents = (parents or chain_parents(len(tokens))) + [d - 1] + list(range(start, start + len(rest) - 1))
        return Speculation(tokens + rest, None, source, parents, lookup_from=start)


def auto_leaves(cap: list[int], accept_rate: float, leaf_rates: list[float], node_cost: float | None) -> list[int]:
    """Leaves per spine depth, up to ``cap``, each kept while it pays.

    Leaf r beside spine node d adds ``P(reach d) · (1 - a) · P(no earlier leaf) · ρ_r`` expected tokens per round
    (a: the spine's acceptance, ρ_r: leaf rank r's measured acceptance, ``leaf_rates[r]``); it costs one tree node,
    which slows the round by the verifier's measured ``node_cost`` (a fraction of its verify) and so is worth
    ``node_cost · E[tokens per round]`` tokens. Without a measured cost, the cap."""
    if node_cost is None:
        return list(cap)
    k = len(cap)
    a = min(accept_rate, 0.999)
    price = node_price(node_cost, a, k)
    out, reach = [], 1.0
    for d in range(k):
        left, n = reach * (1 - a), 0  # P(the spine is rejected here and no leaf so far was accepted)
        while n < min(cap[d], len(leaf_rates)) and left * leaf_rates[n] > price:
            left *= 1 - leaf_rates[n]
            n += 1
        out.append(n)
        reach *= a
    return out


def spine_tokens(accept_rate: float, k: int) -> float:
    """A K-spine's expected tokens per round, bonus included: ``(1 - a^(K+1)) / (1 - a)``."""
    a = min(accept_rate, 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


def node_price(node_cost: float, accept_rate: float, k: int) -> float:
    """What one more tree node costs in expected tokens per round: ``node_cost`` (its share of the verify) times
    a K-spine's expected tokens per round (:func:`spine_tokens`)."""
    return node_cost * spine_tokens(accept_rate, k)


def step_time(step_s: list[float], n: int) -> float:
    """A step of ``n`` tokens from the table ``step_s`` (``step_s[i]``: i + 1 tokens), extended past its end along
    its last two sizes."""
    if n <= len(step_s):
        return step_s[max(n, 1) - 1]
    slope = max(step_s[-1] - step_s[-2], 0.0) if len(step_s) > 1 else 0.0
    return step_s[-1] + slope * (n - len(step_s))


def lookup_for_steps(accept: list[float], spine_tokens: float, base: int, step_s: list[float]) -> int:
    """How many lookup nodes m make a round most productive: the m in 0..len(accept) maximising
    ``(spine_tokens + Σ_{j<m} accept_j) / T(base + m)``.

    ``accept[j]``: lookup node j's measured P(accepted | drafted), the tokens it adds (held non-increasing: node j
    is only accepted after node j - 1); ``spine_tokens``: a round's expected tokens without the branch;
    ``base``: the step's tokens without it (other requests', the root, spine and leaves); ``step_s``: the
    verifier's measured step seconds by size (:class:`spec_core.estimators.StepTimes`). Unlike a price per node,
    this sees the verify's stair: nodes that fit below it are free, and a node past it pays only together with
    the ones behind it."""
    best, best_rate, gain, cap = 0, spine_tokens / step_time(step_s, base), spine_tokens, 1.0
    for m, a in enumerate(accept, start=1):
        cap = min(cap, max(a, 0.0))
        gain += cap
        rate = gain / step_time(step_s, base + m)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = m, rate
    return best


#: While its measured acceptance keeps a request's lookup branch out, one build in this many drafts it anyway, so
#: that the estimate can recover when the text turns repetitive (it would never be measured again otherwise).
LOOKUP_EXPLORE_EVERY = 4


@dataclass(slots=True)
class LookupStats:
    """One request's prompt-lookup branch, measured per lookup node m (0: the node where it leaves the spine):
    P(accepted | drafted), to price it, and P(the round ends on it), for its fan-out. Per request and quick to
    forget, since how often lookup is right swings between requests (8 HumanEval prompts: 6% to 89% for its first
    node) and within one as it turns repetitive."""

    accept: list[RateEstimator] = field(
        default_factory=lambda: [RateEstimator(0.3, prior_weight=3.0, half_life=32.0) for _ in range(16)])
    end: list[RateEstimator] = field(
        default_factory=lambda: [RateEstimator(0.1, prior_weight=3.0, half_life=32.0) for _ in range(16)])
    priced_out: int = 0

    def keep(self, most: int, price: float | None) -> int:
        """How many lookup nodes (up to ``most``) the next build drafts: each while its acceptance pays ``price``
        (:func:`node_price`), all without a price, and all once every :data:`LOOKUP_EXPLORE_EVERY` builds that
        would draft none."""
        if price is None:
            return most
        n = 0
        while n < min(most, len(self.accept)) and self.accept[n].value > price:
            n += 1
        return self._explore(n, most)

    def budget(self, most: int, accept_rate: float, k: int, base: int, step_s: list[float] | None,
               node_cost: float | None) -> int:
        """The next build's lookup nodes for a K-spine of acceptance ``accept_rate`` in a step of ``base`` other
        tokens: priced by the verifier's measured step times where given (:func:`lookup_for_steps`), else by its
        per-node cost (:meth:`keep`; all ``most`` without either)."""
        if step_s:
            accept = [e.value for e in self.accept[:most]]
            return self._explore(lookup_for_steps(accept, spine_tokens(accept_rate, k), base, step_s), most)
        return self.keep(most, node_price(node_cost, accept_rate, k) if node_cost else None)

    def _explore(self, n: int, most: int) -> int:
        if n == 0:
            self.priced_out += 1
            n = most if self.priced_out % LOOKUP_EXPLORE_EVERY == 0 else 0
        return n

    def observe(self, first: int, num_nodes: int, path: list[int]) -> None:
        """A verified tree whose lookup nodes are ``first .. num_nodes - 1``, and its accepted ``path``."""
        for m, node in enumerate(range(first, num_nodes)):
            self.accept[m].update(node in path)
            self.end[m].update(bool(path) and path[-1] == node)


def glue_mask(paths: list[list[int]], width: int) -> torch.Tensor:
    """``[branches, width]`` bool: which of a speculation's glue slots (the root, then its ``width - 1`` nodes) each
    branch attends: the root and the nodes on the path to its outcome slot (``paths[b]``, node indices)."""
    mask = torch.zeros(len(paths), width, dtype=torch.bool)
    rows = [b for b, path in enumerate(paths) for _ in range(len(path) + 1)]
    cols = [c for path in paths for c in (0, *(p + 1 for p in path))]
    mask[rows, cols] = True
    return mask
