from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "stop_token_ids", "logprobs", "request_id", "top_logprobs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: bool
    request_id: str
    top_logprobs: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[bool] = ..., request_id: _Optional[str] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, chosen: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "token_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., token_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("ttft_s", "decode_s", "tokens_per_s", "num_rounds", "mean_tokens_per_round", "acceptance_rate", "acceptance_by_position", "num_drafted", "num_accepted", "num_plain_rounds")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_PLAIN_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    decode_s: float
    tokens_per_s: float
    num_rounds: int
    mean_tokens_per_round: float
    acceptance_rate: float
    acceptance_by_position: _containers.RepeatedScalarFieldContainer[float]
    num_drafted: int
    num_accepted: int
    num_plain_rounds: int
    def __init__(self, ttft_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., num_rounds: _Optional[int] = ..., mean_tokens_per_round: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., acceptance_by_position: _Optional[_Iterable[float]] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., num_plain_rounds: _Optional[int] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("request_id", "mode", "token_ids", "text", "finish_reason", "num_prompt_tokens", "logprobs", "stats", "token_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    mode: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    stats: RequestStats
    token_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., mode: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., token_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: TokenDelta
    final: GenerateResult
    def __init__(self, delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., final: _Optional[_Union[GenerateResult, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("mode", "running", "queued", "kv_usage", "tokens_emitted", "rounds", "acceptance_rate", "mean_tokens_per_round", "cache_hit_rate", "drafter_connected", "stats")
    MODE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_EMITTED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    running: int
    queued: int
    kv_usage: float
    tokens_emitted: int
    rounds: int
    acceptance_rate: float
    mean_tokens_per_round: float
    cache_hit_rate: float
    drafter_connected: bool
    stats: _struct_pb2.Struct
    def __init__(self, mode: _Optional[str] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., kv_usage: _Optional[float] = ..., tokens_emitted: _Optional[int] = ..., rounds: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_tokens_per_round: _Optional[float] = ..., cache_hit_rate: _Optional[float] = ..., drafter_connected: _Optional[bool] = ..., stats: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "vocab_hash", "vocab_size", "k", "budget", "sampling_mode", "backup", "wait_fraction", "target_params")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_HASH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_MODE_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    WAIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_PARAMS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    vocab_hash: str
    vocab_size: int
    k: int
    budget: int
    sampling_mode: str
    backup: str
    wait_fraction: float
    target_params: int
    def __init__(self, protocol_version: _Optional[int] = ..., vocab_hash: _Optional[str] = ..., vocab_size: _Optional[int] = ..., k: _Optional[int] = ..., budget: _Optional[int] = ..., sampling_mode: _Optional[str] = ..., backup: _Optional[str] = ..., wait_fraction: _Optional[float] = ..., target_params: _Optional[int] = ...) -> None: ...

class HelloAck(_message.Message):
    __slots__ = ("protocol_version", "pid", "model", "device", "affinity", "strategy")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    pid: int
    model: str
    device: str
    affinity: _containers.RepeatedScalarFieldContainer[int]
    strategy: str
    def __init__(self, protocol_version: _Optional[int] = ..., pid: _Optional[int] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., affinity: _Optional[_Iterable[int]] = ..., strategy: _Optional[str] = ...) -> None: ...

class SamplingSpec(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "coupled")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COUPLED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    coupled: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., coupled: _Optional[bool] = ...) -> None: ...

class Prefill(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "k")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: bytes
    params: SamplingSpec
    k: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., params: _Optional[_Union[SamplingSpec, _Mapping]] = ..., k: _Optional[int] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("request_id", "round", "verified_ids", "num_accepted", "bonus", "next_k", "verify_s", "no_jit", "verified_parents", "slot", "node_cost", "step_s", "step_others")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    NEXT_K_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    NO_JIT_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_PARENTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NODE_COST_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    STEP_OTHERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    verified_ids: bytes
    num_accepted: int
    bonus: int
    next_k: int
    verify_s: float
    no_jit: bool
    verified_parents: bytes
    slot: int
    node_cost: float
    step_s: _containers.RepeatedScalarFieldContainer[float]
    step_others: int
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., verified_ids: _Optional[bytes] = ..., num_accepted: _Optional[int] = ..., bonus: _Optional[int] = ..., next_k: _Optional[int] = ..., verify_s: _Optional[float] = ..., no_jit: _Optional[bool] = ..., verified_parents: _Optional[bytes] = ..., slot: _Optional[int] = ..., node_cost: _Optional[float] = ..., step_s: _Optional[_Iterable[float]] = ..., step_others: _Optional[int] = ...) -> None: ...

class Free(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class DrafterEvent(_message.Message):
    __slots__ = ("hello", "prefill", "outcome", "free")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    prefill: Prefill
    outcome: Outcome
    free: Free
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., prefill: _Optional[_Union[Prefill, _Mapping]] = ..., outcome: _Optional[_Union[Outcome, _Mapping]] = ..., free: _Optional[_Union[Free, _Mapping]] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("token_ids", "draft_probs", "source", "prob_ids", "prob_values", "prob_width", "parents", "lookup_from")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROB_IDS_FIELD_NUMBER: _ClassVar[int]
    PROB_VALUES_FIELD_NUMBER: _ClassVar[int]
    PROB_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FROM_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    draft_probs: bytes
    source: str
    prob_ids: bytes
    prob_values: bytes
    prob_width: int
    parents: bytes
    lookup_from: int
    def __init__(self, token_ids: _Optional[bytes] = ..., draft_probs: _Optional[bytes] = ..., source: _Optional[str] = ..., prob_ids: _Optional[bytes] = ..., prob_values: _Optional[bytes] = ..., prob_width: _Optional[int] = ..., parents: _Optional[bytes] = ..., lookup_from: _Optional[int] = ...) -> None: ...

class Branch(_message.Message):
    __slots__ = ("slot", "bonus", "speculation")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    slot: int
    bonus: int
    speculation: Speculation
    def __init__(self, slot: _Optional[int] = ..., bonus: _Optional[int] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ...) -> None: ...

class Bundle(_message.Message):
    __slots__ = ("request_id", "round", "base_ids", "branches", "built_at", "base_parents")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BASE_IDS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    BUILT_AT_FIELD_NUMBER: _ClassVar[int]
    BASE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    base_ids: bytes
    branches: _containers.RepeatedCompositeFieldContainer[Branch]
    built_at: float
    base_parents: bytes
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., base_ids: _Optional[bytes] = ..., branches: _Optional[_Iterable[_Union[Branch, _Mapping]]] = ..., built_at: _Optional[float] = ..., base_parents: _Optional[bytes] = ...) -> None: ...

class JitSpeculation(_message.Message):
    __slots__ = ("request_id", "round", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    speculation: Speculation
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ...) -> None: ...

class ChainUpdate(_message.Message):
    __slots__ = ("request_id", "round", "start", "speculation", "busy_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    start: int
    speculation: Speculation
    busy_s: float
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., start: _Optional[int] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., busy_s: _Optional[float] = ...) -> None: ...

class DrafterMessage(_message.Message):
    __slots__ = ("ack", "bundle", "jit", "chain")
    ACK_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    JIT_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    ack: HelloAck
    bundle: Bundle
    jit: JitSpeculation
    chain: ChainUpdate
    def __init__(self, ack: _Optional[_Union[HelloAck, _Mapping]] = ..., bundle: _Optional[_Union[Bundle, _Mapping]] = ..., jit: _Optional[_Union[JitSpeculation, _Mapping]] = ..., chain: _Optional[_Union[ChainUpdate, _Mapping]] = ...) -> None: ...
