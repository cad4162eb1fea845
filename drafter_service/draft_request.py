"""The SSD drafter's view of one request (:class:`DraftRequest`): its tokens, K/V progress, bundle and lookup."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from drafter_service.candidate_trees import LookupStats
from spec_core.config import SamplingParams
from spec_core.ngram import NgramIndex
from spec_core.sequence import Sequence
from spec_core.speculation import BranchBundle


@dataclass(slots=True)
class DraftRequest:
    """The drafter's view of one request: its tokens (the last is the latest bonus) and K/V progress."""

    seq: Sequence
    k: int
    num_computed: int = 0
    round: int = -1
    bundle: BranchBundle | None = None
    #: Per glue position j: the draft's ranked candidate bonus tokens (drafted token excluded), for r's estimate.
    candidates: dict[int, list[int]] = field(default_factory=dict)
    #: Where the speculation the current bundle was built on came from (cache, jit, prefill or backup), and
    #: where its prompt-lookup branch starts (None: it has none).
    base_source: str = "prefill"
    base_lookup: int | None = None
    #: Prompt lookup over the request's tokens, for the lookup branch of every outcome's tree, and its measures.
    lookup: NgramIndex = field(default_factory=NgramIndex)
    lookup_stats: LookupStats = field(default_factory=LookupStats)


def glue_start(r: DraftRequest) -> int:
    """Where ``r``'s glue forward starts: its first token without K/V (the last token always re-runs)."""
    return min(r.num_computed, r.seq.num_tokens - 1)


def drafter_params(params: SamplingParams) -> SamplingParams:
    """A request's sampling parameters on the drafter: its own random stream, independent of the verifier's
    acceptance uniforms (a coupled request keeps the verifier's seed: its drafter races with it)."""
    if params.coupled:
        return params
    return replace(params, seed=None if params.seed is None else (params.seed * 1_000_003 + 0x5EED) % (1 << 63))
