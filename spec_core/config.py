"""Configuration as frozen dataclasses. Each validates itself and raises ``ValueError`` naming the bad value.

Imports no torch at module level, so the CLI validates flags and input files before paying for torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from spec_core.dtypes import (  # noqa: F401  (the dtype names and their resolution, re-exported)
    WEIGHT_ONLY,
    check_dtype,
    draft_dtype,
    native_bf16,
    native_int4,
    parse_dtype,
    resolve_dtype,
    weight_format,
)
from spec_core.fanout import FanoutConfig

if TYPE_CHECKING:
    import torch

Mode = Literal["ar", "sd", "ssd"]
MODES: tuple[str, ...] = ("ar", "sd", "ssd")
#: Lookahead K, the most tokens a round speculates, for every command and config that is not told otherwise
#: (adaptive K plans each step at or below it). 3 measured best or tied for SSD on both pairs on CPUs.
DEFAULT_K = 3


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Where a model lives and how to load it."""

    path: str
    dtype: str = "float32"
    device: str = "cpu"
    #: Pad small forwards to the row count measured fastest at load (:mod:`spec_core.backends.cpu.row_padding`).
    pad_rows: bool = True
    #: Run the decoder's small ops as compiled CPU loops (:mod:`spec_core.backends.cpu.cpu_kernels`; never for fp32).
    cpu_kernels: bool = True
    #: A draft's LM head over this many of the most frequent token ids (0: all; None: auto, see
    #: :mod:`spec_core.draft_vocab`). Never a target's: its logits are the output distribution.
    head_vocab: int | None = None
    #: On a CUDA device, replay decode, verify and draft steps as CUDA graphs per batch bucket
    #: (:mod:`spec_core.backends.cuda_graphs`); off: every forward eager. Nothing changes elsewhere.
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        if self.head_vocab is not None and self.head_vocab < 0:
            raise ValueError(f"head_vocab must be a count of token ids (0: all), got {self.head_vocab}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.resolved_dtype, self.device)

    @property
    def weights(self) -> str | None:
        return weight_format(self.resolved_dtype, self.device)

    @property
    def resolved_dtype(self) -> str:
        """The dtype actually used (``auto`` resolved for this model on the device: :func:`resolve_dtype`)."""
        return resolve_dtype(self.dtype, self.device, self.path, self.cpu_kernels)


#: How an engine's sampled requests draw (``EngineConfig.sampling``; :mod:`spec_core.coupling`).
SAMPLING_RULES = ("auto", "residual", "coupled")

#: The most alternatives a request may ask for at each position (OpenAI allows 20).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters. ``seed`` makes a
    sampled request reproducible. Generated token ids include the stop/EOS token that ended the request (as
    transformers does); ``ignore_eos`` generates exactly ``max_new_tokens``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    #: Also return the target's log-probability of each generated token (raw logits, before temperature/top-p).
    logprobs: bool = False
    #: And the ``top_logprobs`` most likely tokens at each position (0..20; > 0 implies ``logprobs``).
    top_logprobs: int = 0
    #: Coupled sampling (:mod:`spec_core.coupling`): each token is an exact draw that depends only on the seed, its
    #: position and the target's distribution there, never on the drafts. None: the engine's rule decides
    #: (``EngineConfig.sampling``), which sets it on admission; always False when greedy.
    coupled: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite")
        if not (0 < self.top_p <= 1) or math.isnan(self.top_p):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            object.__setattr__(self, "logprobs", True)
        if self.coupled and self.temperature == 0:  # greedy is already deterministic: ``coupled`` means sampled
            object.__setattr__(self, "coupled", False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def deterministic(self) -> bool:
        """Greedy, or coupled: the token at each position is a function of the prefix (and the seed), so a draft
        is verified by an argmax match, needs no q rows, and any drafter (the n-gram backup too) is exact."""
        return self.temperature == 0 or bool(self.coupled)


def lookup_depth(k: int) -> int:
    """How deep a tree's prompt-lookup branch may reach at lookahead ``k``: 2K (16 at most). A copied run is often
    longer than what the draft gets right, and under ``--tree auto`` each of its nodes must pay for itself."""
    return min(2 * k, 16)


#: The most leaves ``--tree auto`` may choose per spine depth (widths; the verifier reserves KV slots for it).
AUTO_TREE_CEILING = (5, 3, 2)


@dataclass(frozen=True, slots=True)
class TreeShape:
    """The candidate tree drafted for each speculation: a spine of K tokens (the draft's pick at each depth) and,
    at spine depth d + 1, ``widths[d] - 1`` more of the draft's choices as leaves beside the spine node (depths
    past ``widths`` have none). The leaves come from the logits that picked the spine token, so they cost the
    drafter nothing; the verifier pays one more tree node each. No leaves is a chain. For a sampled request the
    leaves are independent draws from the spine node's q (with replacement), as exact multi-branch verification
    requires. Written ``chain``, ``WxL`` (width W at the first L depths) or ``W1,W2,...`` (one width per depth).

    ``auto`` (written ``auto`` or ``auto:W1,W2,...``): ``widths`` is a ceiling, and the drafter chooses the leaves
    per depth for every bundle from measured acceptance (the spine's and each leaf rank's) and the verifier's
    measured cost of one more tree node (:meth:`drafter_service.ssd_drafter.SSDDrafter.leaves_for`).

    ``lookup`` (suffix ``+lookup``; on by default for ``auto``, off with ``+nolookup``): a greedy request's tree also
    gets a *prompt-lookup branch*: what followed the latest earlier match of the outcome context's last 3 (or 2)
    tokens (:class:`spec_core.ngram.NgramIndex`), merged with the spine where they agree and hung beside it from
    where they part, at most :func:`lookup_depth` deep. It costs the drafter no forward; under ``auto`` its nodes
    are kept while their measured acceptance pays for their verify cost."""

    widths: tuple[int, ...] = ()
    auto: bool = False
    lookup: bool = False

    def __post_init__(self) -> None:
        if len(self.widths) > 16 or any(not 1 <= w <= 8 for w in self.widths):
            raise ValueError(f"tree widths must be 1..8 for at most 16 depths, got {self.widths}")

    @classmethod
    def uniform(cls, width: int, levels: int) -> TreeShape:
        return cls((width,) * levels)

    @property
    def is_chain(self) -> bool:
        return all(w == 1 for w in self.widths) and not self.lookup

    def leaves(self, k: int) -> list[int]:
        """Leaves beside spine node d (depth d + 1) for d < k."""
        return [(self.widths[d] - 1 if d < len(self.widths) else 0) for d in range(k)]

    def max_nodes(self, k: int) -> int:
        """The most nodes of a speculation at lookahead ``k``: the spine, its leaves and the lookup branch."""
        return k + sum(self.leaves(k)) + (lookup_depth(k) if self.lookup else 0)

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        text = str(text).strip().lower()
        for suffix, on in (("+lookup", True), ("+nolookup", False)):
            if text.endswith(suffix):
                return replace(cls.parse(text[: -len(suffix)]), lookup=on)
        if text == "auto":
            return cls(AUTO_TREE_CEILING, auto=True, lookup=True)
        if text.startswith("auto:"):
            return cls(cls.parse(text[5:]).widths, auto=True, lookup=True)
        try:
            if text == "chain":
                return cls()
            if "x" in text:
                width, levels = (int(x) for x in text.split("x"))
                return cls.uniform(width, levels)
            return cls(tuple(int(x) for x in text.split(",")))
        except ValueError:
            raise ValueError(f"tree shape must be chain, WIDTHxLEVELS (such as 2x2) or widths per depth (such as "
                             f"4,2), got {text!r}") from None

    def __str__(self) -> str:
        suffix = ("" if self.lookup else "+nolookup") if self.auto else ("+lookup" if self.lookup else "")
        return self._widths_str() + suffix

    def _widths_str(self) -> str:
        widths = self.widths
        while widths and widths[-1] == 1:
            widths = widths[:-1]
        if self.auto:
            return "auto" if widths == AUTO_TREE_CEILING else "auto:" + ",".join(str(w) for w in widths)
        if not widths:
            return "chain"
        if len(set(widths)) == 1:
            return f"{widths[0]}x{len(widths)}"
        return ",".join(str(w) for w in widths)


#: The default candidate tree for ``--mode ssd`` (``ssd bench --sweep tree`` measures the alternatives).
SSD_DEFAULT_TREE = TreeShape(AUTO_TREE_CEILING, auto=True, lookup=True)


#: The SSD drafter's strategies (``SSDConfig.strategy``).
SSD_STRATEGIES = ("auto", "fanout", "run-ahead")
#: ``auto`` runs ahead where the draft reads at least this share of the target's weights per decoded token
#: (:func:`spec_core.arch.decode_params`): a decode step reads every weight once, so this is about the share of a
#: target step that one draft step costs. At 0.32 (Qwen2.5-Coder 0.5B under 1.5B) a draft step measured 0.39 of
#: a target step and a fan-out could not build one branch within a verify; at 0.13 (the default pair) it builds
#: a dozen.
RUN_AHEAD_WEIGHT_SHARE = 0.25


def resolve_strategy(strategy: str, draft_params: int, target_params: int) -> str:
    """``fanout`` or ``run-ahead``: ``strategy`` itself unless ``auto`` (then by the models' parameter counts)."""
    if strategy != "auto":
        return strategy
    return "run-ahead" if draft_params >= RUN_AHEAD_WEIGHT_SHARE * target_params else "fanout"


@dataclass(frozen=True, slots=True)
class SSDConfig:
    """The SSD drafter: K tokens per speculation, the fan-out over outcomes, Saguaro's C and its KV pool."""

    k: int = DEFAULT_K
    fanout: FanoutConfig = field(default_factory=FanoutConfig)
    saguaro_c: float = 1.0
    #: The drafter proposes from its top-n tokens only (renormalised; exact, see ``truncate_top_n``), so sampled
    #: speculations ship n (id, prob) pairs per token instead of a vocabulary-sized row. 0 = the full q.
    proposal_top_n: int = 64
    num_blocks: int = 1024
    block_size: int = 16
    #: The tree drafted per outcome for greedy requests; a chain is the paper's SSD.
    tree: TreeShape = field(default_factory=lambda: SSD_DEFAULT_TREE)
    #: ... and for sampled ones (leaves are i.i.d. draws). A chain by default: at T = 0.8 on the real pair,
    #: trees halved the cache-hit rate and ran slower than chains (README, "SSD candidate trees").
    sampled_tree: TreeShape = field(default_factory=TreeShape)
    #: Where a request's trees have a prompt-lookup branch, guess each outcome's bonus with prompt lookup as well
    #: as the draft: its guess is every slot's first candidate (:func:`drafter_service.candidate_trees.
    #: bonus_candidates`). Not for chains: there the hits it adds replace rounds that the n-gram backup served
    #: better (HumanEval, interleaved: 1.92 against 2.36 tokens per round).
    lookup_bonus: bool = True
    #: ``--tree auto`` sizes the lookup branch by the verifier's measured step time at each size (a staircase),
    #: where the verifier sends one, instead of by its per-node cost (a line's slope). Off by default: in an
    #: interleaved A/B it ran 1.035-1.065x chains' tok/s against the slope's 1.006-1.087x, within the noise,
    #: at fewer tokens per round (1.10-1.15x against 1.13-1.15x).
    price_by_step: bool = False
    #: The share of the verifier's step that one batch of bundles may take to build. The per-request fan-out
    #: budget shrinks below ``fanout.budget`` where the drafter's fitted build time says the batch would not fit
    #: (many requests, a slow drafter). None always builds the full budget. An in-process (loopback) drafter,
    #: which builds inside the verifier's step, has nothing to fit and ignores it.
    fit_fanout: float | None = 1.0
    #: How the drafter spends its time (:data:`SSD_STRATEGIES`): ``fanout`` pre-drafts a tree per likely outcome
    #: of every round (:mod:`drafter_service.ssd_drafter`), ``run-ahead`` keeps one chain per request running
    #: ahead of the verifier (:mod:`drafter_service.run_ahead`), ``auto`` picks run-ahead where the draft costs
    #: too much for a fan-out (:func:`resolve_strategy`).
    strategy: str = "auto"
    #: Run-ahead only: how many tokens past the committed ones a chain may run (None: 2K + 1).
    run_ahead_depth: int | None = None

    @property
    def max_nodes(self) -> int:
        """The largest speculation this drafter sends: K spine nodes, the tree's leaves and its lookup branch."""
        return max(self.tree.max_nodes(self.k), self.sampled_tree.max_nodes(self.k))

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 16:
            raise ValueError(f"k must be in [1, 16], got {self.k}")
        if not 0 < self.saguaro_c <= 1:
            raise ValueError(f"saguaro_c must be in (0, 1], got {self.saguaro_c}")
        if self.fit_fanout is not None and not self.fit_fanout > 0:
            raise ValueError(f"fit_fanout must be > 0 or None, got {self.fit_fanout}")
        if self.strategy not in SSD_STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(SSD_STRATEGIES)}, got {self.strategy!r}")
        if self.run_ahead_depth is not None and not 1 <= self.run_ahead_depth <= 64:
            raise ValueError(f"run_ahead_depth must be in [1, 64] or None, got {self.run_ahead_depth}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """A KV pool: ``num_blocks`` blocks of ``block_size`` tokens; ``num_blocks`` None sizes it from the device's
    free memory (``kv_memory_fraction``; on a CPU without a fraction, the service's fixed default)."""

    num_blocks: int | None = None
    block_size: int = 16
    kv_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or (self.num_blocks is not None and self.num_blocks <= 0):
            raise ValueError(f"block_size and num_blocks must be > 0, got {self.block_size}, {self.num_blocks}")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """How the verifier speculates: the mode, K, the SSD drafter's fan-out budget and Saguaro C (which the
    handshake checks), the backup on a miss, and whether K adapts per step to measured costs."""

    mode: str = "ssd"
    k: int = DEFAULT_K
    budget: int = FanoutConfig().budget
    saguaro_c: float = 1.0
    fanout: str = "geometric"
    backup: str = "ngram"
    wait_fraction: float = 0.5
    backup_policy: str = "auto"
    #: K per step and request from measured costs, down to 0 (plain decoding) when speculation does not pay.
    adaptive_k: bool = True
    #: SSD's candidate tree per outcome (the drafter's; the verifier reserves KV slots for it).
    tree: TreeShape = field(default_factory=lambda: SSD_DEFAULT_TREE)
    #: How sampled requests draw (the engine's ``EngineConfig.sampling``): auto, residual or coupled.
    sampling: str = "auto"
    #: How a local run-ahead pair shares its two cores: auto (measured), pipelined or alternating
    #: (:mod:`verifier_service.run_ahead_schedule`).
    run_ahead_schedule: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.sampling not in SAMPLING_RULES:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLING_RULES)}, got {self.sampling!r}")
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")

    @property
    def lookahead(self) -> int:
        """Draft tokens per round: K, or 0 in AR mode."""
        return self.k if self.mode != "ar" else 0
