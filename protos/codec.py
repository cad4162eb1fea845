"""The one codec between ``ssd.v1`` protobuf messages and our typed dataclasses (:mod:`spec_core.speculation`).

Blob layouts are documented in ``ssd.proto``: token ids are packed little-endian int32, draft probability rows
little-endian float32 ``[rows, vocab]``. Every decode validates sizes and raises :class:`ValueError` on a
malformed message, so a server can answer INVALID_ARGUMENT instead of crashing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np

from protos.prob_blobs import pack_probs, pack_sparse_many, pack_sparse_probs, unpack_probs, unpack_sparse_probs
from protos.ssd.v1 import ssd_pb2 as pb
from spec_core.chat import ChatPrompt, Prompt
from spec_core.config import SamplingParams
from spec_core.estimators import STEP_TABLE_TOKENS
from spec_core.speculation import (
    BranchBundle,
    ChainMsg,
    FreeEvent,
    OutcomeEvent,
    PrefillEvent,
    Speculation,
    SpeculationMsg,
)

PROTOCOL_VERSION = 1
DEFAULT_MAX_NEW_TOKENS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 128
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


# ---- blobs ----------------------------------------------------------------------------------------------------
def pack_ids(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype=_I32).tobytes()


def unpack_ids(blob: bytes) -> list[int]:
    if len(blob) % 4:
        raise ValueError(f"token-id blob of {len(blob)} bytes is not a whole number of int32")
    return np.frombuffer(blob, dtype=_I32).tolist()


def pack_parents(parents: list[int] | None) -> bytes:
    """A tree's parent indices (int32; -1 is the root); a chain (None) is empty."""
    return b"" if parents is None else pack_ids(parents)


def unpack_parents(blob: bytes) -> list[int] | None:
    return unpack_ids(blob) if blob else None



# ---- public API -----------------------------------------------------------------------------------------------
def request_to_params(req: pb.GenerateRequest) -> tuple[Prompt, SamplingParams]:
    """(prompt text, token ids or messages; validated params). Raises ValueError with a user-facing message."""
    has_text, has_ids, has_msgs = bool(req.prompt), len(req.prompt_token_ids) > 0, len(req.messages) > 0
    if has_text + has_ids + has_msgs > 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
    if not (has_text or has_ids or has_msgs):
        raise ValueError("prompt is empty")
    for name in ("temperature", "top_p"):
        if req.HasField(name) and not math.isfinite(getattr(req, name)):
            raise ValueError(f"{name} must be a finite number, got {getattr(req, name)}")
    params = SamplingParams(
        temperature=float(req.temperature) if req.HasField("temperature") else 0.0,
        top_p=float(req.top_p) if req.HasField("top_p") else 1.0,
        top_k=int(req.top_k),
        seed=int(req.seed) if req.HasField("seed") else None,
        max_new_tokens=int(req.max_new_tokens) if req.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS,
        stop_token_ids=tuple(req.stop_token_ids),
        stop=tuple(s for s in req.stop),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        top_logprobs=int(req.top_logprobs),
    )
    if any(not s for s in params.stop):
        raise ValueError("stop strings must be non-empty")
    if len(params.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in params.stop):
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    if has_msgs:
        prompt: Prompt = ChatPrompt.of([{"role": m.role, "content": m.content} for m in req.messages])
    else:
        prompt = req.prompt if has_text else list(req.prompt_token_ids)
    return prompt, params


def params_to_request(prompt: Prompt, params: SamplingParams, request_id: str = "") -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, ignore_eos=params.ignore_eos, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids), logprobs=params.logprobs, request_id=request_id,
        top_logprobs=params.top_logprobs,
    )
    if isinstance(prompt, ChatPrompt):
        req.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in prompt.messages)
    elif isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(prompt)
    if params.seed is not None:
        req.seed = params.seed
    return req


#: Our finish reasons (``Sequence.finish_reason``) and the wire enum; "abort" is OpenAI's and vLLM's name.
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "cancelled": pb.FINISH_REASON_ABORT}
_FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def finish_reason_to_pb(reason: str | None) -> int:
    return _FINISH.get(reason or "", pb.FINISH_REASON_UNSPECIFIED)


def finish_reason_name(value: int) -> str | None:
    """"stop", "length", "abort", or None (unspecified): the names OpenAI-style APIs use."""
    return _FINISH_NAMES.get(value)


def position_logprobs(chosen: tuple[int, float], top: list[tuple[int, float]], piece) -> pb.PositionLogprobs:
    """One position's logprobs; ``piece(id)`` is the token's text."""
    return pb.PositionLogprobs(
        chosen=pb.TokenLogprob(token_id=chosen[0], token=piece(chosen[0]), logprob=chosen[1]),
        top=[pb.TokenLogprob(token_id=t, token=piece(t), logprob=lp) for t, lp in top])


def stats_to_pb(stats: dict):
    """The server's stats dict as a ``google.protobuf.Struct`` (numbers become doubles; None stays null)."""
    from google.protobuf.struct_pb2 import Struct

    out = Struct()
    out.update(stats)
    return out


def stats_from_pb(resp: pb.StatsResponse) -> dict:
    """The stats dict of a ``GetStats`` answer (whole numbers come back as ints)."""
    from google.protobuf.json_format import MessageToDict

    def ints(v):
        if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 53:
            return int(v)
        if isinstance(v, list):
            return [ints(x) for x in v]
        if isinstance(v, dict):
            return {k: ints(x) for k, x in v.items()}
        return v

    return ints(MessageToDict(resp.stats))


def result_to_json(res: pb.GenerateResult) -> dict:
    """The JSON object ``ssd generate --json`` prints, from a service result."""
    s = res.stats
    out = {
        "mode": res.mode,
        "text": res.text,
        "token_ids": list(res.token_ids),
        "num_generated": len(res.token_ids),
        "num_prompt_tokens": res.num_prompt_tokens,
        "finish_reason": finish_reason_name(res.finish_reason),
        "tokens_per_s": s.tokens_per_s,
        "ttft_s": s.ttft_s,
        "decode_s": s.decode_s,
        "request_id": res.request_id,
    }
    if res.mode != "ar":
        out.update(num_rounds=s.num_rounds, num_plain_rounds=s.num_plain_rounds,
                   mean_tokens_per_round=s.mean_tokens_per_round or None,
                   acceptance_rate=s.acceptance_rate, acceptance_by_position=list(s.acceptance_by_position))
    if res.logprobs:
        out["logprobs"] = list(res.logprobs)
    return out


# ---- drafter protocol -----------------------------------------------------------------------------------------
def sampling_spec(params: SamplingParams) -> pb.SamplingSpec:
    spec = pb.SamplingSpec(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                           coupled=bool(params.coupled))
    if params.seed is not None:
        spec.seed = params.seed
    return spec


def event_to_pb(ev: object) -> pb.DrafterEvent:
    if isinstance(ev, PrefillEvent):
        return pb.DrafterEvent(prefill=pb.Prefill(request_id=ev.request_id, token_ids=pack_ids(ev.token_ids),
                                                  params=sampling_spec(ev.params), k=ev.k))
    if isinstance(ev, OutcomeEvent):
        return pb.DrafterEvent(outcome=pb.Outcome(
            request_id=ev.request_id, round=ev.round, verified_ids=pack_ids(ev.verified),
            num_accepted=ev.num_accepted, bonus=ev.bonus, next_k=ev.next_k, verify_s=ev.verify_s,
            no_jit=not ev.jit, verified_parents=pack_parents(ev.parents), slot=ev.slot, node_cost=ev.node_cost,
            step_s=ev.step_s or [], step_others=ev.step_others))
    if isinstance(ev, FreeEvent):
        return pb.DrafterEvent(free=pb.Free(request_id=ev.request_id))
    raise TypeError(f"not a drafter event: {type(ev).__name__}")


def _step_table(values) -> list[float] | None:
    """An outcome's step-time table (None when empty), checked: at most ``STEP_TABLE_TOKENS`` finite positive
    seconds."""
    table = list(values)
    if len(table) > STEP_TABLE_TOKENS or not all(math.isfinite(t) and t > 0 for t in table):
        raise ValueError(f"step_s must be at most {STEP_TABLE_TOKENS} finite positive seconds")
    return table or None


def event_from_pb(msg: pb.DrafterEvent) -> object:
    kind = msg.WhichOneof("event")
    if kind == "prefill":
        p = msg.prefill
        s = p.params
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
                                seed=s.seed if s.HasField("seed") else None, coupled=s.coupled)
        return PrefillEvent(p.request_id, unpack_ids(p.token_ids), params, p.k)
    if kind == "outcome":
        o = msg.outcome
        return OutcomeEvent(o.request_id, o.round, unpack_ids(o.verified_ids), o.num_accepted, o.bonus, o.next_k,
                            verify_s=o.verify_s, jit=not o.no_jit, parents=unpack_parents(o.verified_parents),
                            slot=o.slot if o.HasField("slot") else None,
                            node_cost=o.node_cost if o.HasField("node_cost") else None,
                            step_s=_step_table(o.step_s), step_others=max(0, o.step_others))
    if kind == "free":
        return FreeEvent(msg.free.request_id)
    raise ValueError(f"unexpected drafter event {kind!r}")


def speculation_to_pb(spec: Speculation, sparse: tuple[bytes, bytes, int] | None = None) -> pb.Speculation:
    """``sparse``: its rows already packed sparse (:func:`pack_sparse_many`); otherwise packed here."""
    msg = pb.Speculation(token_ids=pack_ids(spec.token_ids), source=spec.source,
                         parents=pack_parents(spec.parents or None), lookup_from=spec.lookup_from)
    if spec.draft_probs is not None:
        sparse = sparse or pack_sparse_probs(spec.draft_probs)
        if sparse is None:
            msg.draft_probs = pack_probs(spec.draft_probs)
        else:
            msg.prob_ids, msg.prob_values, msg.prob_width = sparse
    return msg


def speculation_from_pb(msg: pb.Speculation, vocab_size: int, build: bool = True) -> Speculation:
    """The speculation, every field checked; ``build`` False leaves its q rows unbuilt (``draft_probs`` None)."""
    ids = unpack_ids(msg.token_ids)
    if msg.prob_width:
        probs = unpack_sparse_probs(msg.prob_ids, msg.prob_values, len(ids), msg.prob_width, vocab_size, build)
    else:
        probs = unpack_probs(msg.draft_probs, len(ids), vocab_size, build)
    parents = unpack_parents(msg.parents)
    lookup = msg.lookup_from if msg.HasField("lookup_from") else None
    if lookup is not None and (parents is None or not 0 <= lookup < len(ids)):
        raise ValueError(f"lookup_from {lookup} is not a node of this {len(ids)}-node tree")
    return Speculation(ids, probs, msg.source or "cache", parents, lookup)


def message_to_pb(msg: object) -> pb.DrafterMessage:
    if isinstance(msg, BranchBundle):
        packed = pack_sparse_many([s.draft_probs for s in msg.entries.values()])
        branches = [pb.Branch(slot=k, bonus=b, speculation=speculation_to_pb(s, sparse))
                    for ((k, b), s), sparse in zip(msg.entries.items(), packed)]
        return pb.DrafterMessage(bundle=pb.Bundle(request_id=msg.request_id, round=msg.round,
                                                  base_ids=pack_ids(msg.base_tokens), branches=branches,
                                                  built_at=msg.ready_at, base_parents=pack_parents(msg.base_parents)))
    if isinstance(msg, SpeculationMsg):
        return pb.DrafterMessage(jit=pb.JitSpeculation(request_id=msg.request_id, round=msg.round,
                                                       speculation=speculation_to_pb(msg.speculation)))
    if isinstance(msg, ChainMsg):
        if msg.speculation.parents is not None:
            raise ValueError("a run-ahead chain update must be a chain, not a tree")
        return pb.DrafterMessage(chain=pb.ChainUpdate(request_id=msg.request_id, round=msg.round, start=msg.start,
                                                      speculation=speculation_to_pb(msg.speculation),
                                                      busy_s=msg.busy_s))
    raise TypeError(f"not a drafter message: {type(msg).__name__}")


class ReceivedBranches(Mapping[tuple[int, int], Speculation]):
    """A received bundle's branches by (slot, bonus), each checked on arrival (a malformed bundle is refused at
    once) and built into its :class:`Speculation`, q rows made dense, on first use. A verifier uses at most one
    branch of a bundle: building all of a sampled bundle's takes about 0.5 ms of its step."""

    def __init__(self, branches, vocab_size: int) -> None:
        self._msgs: dict[tuple[int, int], pb.Speculation] = {}
        for br in branches:
            speculation_from_pb(br.speculation, vocab_size, build=False)
            self._msgs[(br.slot, br.bonus)] = br.speculation
        self._vocab_size = vocab_size
        self._built: dict[tuple[int, int], Speculation] = {}

    def __getitem__(self, key: tuple[int, int]) -> Speculation:
        if key not in self._built:
            self._built[key] = speculation_from_pb(self._msgs[key], self._vocab_size)
        return self._built[key]

    def __contains__(self, key: object) -> bool:
        return key in self._msgs

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._msgs)

    def __len__(self) -> int:
        return len(self._msgs)


def message_from_pb(msg: pb.DrafterMessage, vocab_size: int) -> object:
    kind = msg.WhichOneof("msg")
    if kind == "bundle":
        b = msg.bundle
        entries = ReceivedBranches(b.branches, vocab_size)
        return BranchBundle(b.request_id, b.round, unpack_ids(b.base_ids), entries, ready_at=b.built_at,
                            base_parents=unpack_parents(b.base_parents))
    if kind == "jit":
        j = msg.jit
        return SpeculationMsg(j.request_id, j.round, speculation_from_pb(j.speculation, vocab_size))
    if kind == "chain":
        c = msg.chain
        spec = speculation_from_pb(c.speculation, vocab_size)
        if spec.parents is not None or c.start < 1:
            raise ValueError(f"a chain update must be a chain starting past the prompt's first token (start {c.start})")
        return ChainMsg(c.request_id, c.round, c.start, spec, c.busy_s)
    raise ValueError(f"unexpected drafter message {kind!r}")


# ---- handshake ------------------------------------------------------------------------------------------------
def sampling_mode(saguaro_c: float, fanout_kind: str, tree: object = "chain") -> str:
    """What both ends must agree on beyond K and the budget: C, the fan-out kind and the candidate tree's shape
    (the verifier reserves KV slots for the drafter's largest tree)."""
    return f"saguaro:C={saguaro_c:g};fanout={fanout_kind};tree={tree}"


def make_hello(vocab_hash: str, vocab_size: int, k: int, budget: int, mode: str, backup: str = "ngram",
               wait_fraction: float = 0.5, target_params: int = 0) -> pb.Hello:
    """``target_params``: the target's weights read per decoded token, for the drafter's ``auto`` strategy."""
    return pb.Hello(protocol_version=PROTOCOL_VERSION, vocab_hash=vocab_hash, vocab_size=vocab_size, k=k,
                    budget=budget, sampling_mode=mode, backup=backup, wait_fraction=wait_fraction,
                    target_params=target_params)


def backup_settings(hello: pb.Hello) -> tuple[str, float]:
    """The verifier's (backup, wait_fraction) from its hello, which the drafter follows (defaults if unset)."""
    backup = hello.backup or "ngram"
    if backup not in ("ngram", "none"):
        raise ValueError(f"hello: unknown backup {backup!r}; choose ngram or none")
    return backup, hello.wait_fraction if hello.HasField("wait_fraction") else 0.5


def hello_mismatch(got: pb.Hello, want: pb.Hello) -> list[str]:
    """Every field on which a verifier's Hello disagrees with the drafter's own (empty: a valid pairing)."""
    problems = []
    for name in ("protocol_version", "vocab_hash", "vocab_size", "k", "budget", "sampling_mode"):
        a, b = getattr(got, name), getattr(want, name)
        if a != b:
            problems.append(f"{name}: verifier has {a!r}, drafter has {b!r}")
    return problems
