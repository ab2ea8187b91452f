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
    FINISH_REASON_GRAMMAR_UNSATISFIABLE: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_GRAMMAR_UNSATISFIABLE: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop", "stop_token_ids", "ignore_eos", "seed", "n", "min_new_tokens", "logit_bias", "logprobs", "top_logprobs", "token_ids_logprob", "logprob_start_len", "json_schema", "regex", "ebnf", "lark", "structural_tag", "choice")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    seed: int
    n: int
    min_new_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: bool
    top_logprobs: int
    token_ids_logprob: _containers.RepeatedScalarFieldContainer[int]
    logprob_start_len: int
    json_schema: str
    regex: str
    ebnf: str
    lark: str
    structural_tag: str
    choice: Choices
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., token_ids_logprob: _Optional[_Iterable[int]] = ..., logprob_start_len: _Optional[int] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ..., lark: _Optional[str] = ..., structural_tag: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "input_ids", "sampling", "routing_key", "priority", "tenant", "ttft_slo_ms", "tpot_slo_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    input_ids: TokenIds
    sampling: SamplingParams
    routing_key: str
    priority: int
    tenant: str
    ttft_slo_ms: float
    tpot_slo_ms: float
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., routing_key: _Optional[str] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., ttft_slo_ms: _Optional[float] = ..., tpot_slo_ms: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "finished", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TokenChunk
    finished: Finished
    prompt_logprobs: PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "top_ids", "top_logprobs", "top_tokens", "ids_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_tokens: _containers.RepeatedScalarFieldContainer[str]
    ids_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., top_tokens: _Optional[_Iterable[str]] = ..., ids_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("start", "positions", "text")
    START_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    start: int
    positions: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    text: str
    def __init__(self, start: _Optional[int] = ..., positions: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., text: _Optional[str] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("index", "token_ids", "text", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "ttft_s", "total_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    ttft_s: float
    total_s: float
    def __init__(self, queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("index", "reason", "message", "usage", "timings")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    index: int
    reason: FinishReason
    message: str
    usage: Usage
    timings: Timings
    def __init__(self, index: _Optional[int] = ..., reason: _Optional[_Union[FinishReason, str]] = ..., message: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "device", "dtype", "kv_capacity_tokens", "page_size", "running", "queued", "kv_used_tokens", "book_live_seqs", "book_seq_slots", "reported_live_seqs", "reported_seq_slots", "kv_mismatches", "steps", "retractions", "wait_p50_s", "wait_p99_s", "wait_total_s", "step_total_s", "leaving", "prompt_tokens_total", "cached_tokens_total", "transfer_address", "migrated_out", "migrated_in", "migration_fallbacks", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BOOK_LIVE_SEQS_FIELD_NUMBER: _ClassVar[int]
    BOOK_SEQ_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REPORTED_LIVE_SEQS_FIELD_NUMBER: _ClassVar[int]
    REPORTED_SEQ_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RETRACTIONS_FIELD_NUMBER: _ClassVar[int]
    WAIT_P50_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_P99_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_OUT_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_IN_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    device: str
    dtype: str
    kv_capacity_tokens: int
    page_size: int
    running: int
    queued: int
    kv_used_tokens: int
    book_live_seqs: int
    book_seq_slots: int
    reported_live_seqs: int
    reported_seq_slots: int
    kv_mismatches: int
    steps: int
    retractions: int
    wait_p50_s: float
    wait_p99_s: float
    wait_total_s: float
    step_total_s: float
    leaving: bool
    prompt_tokens_total: int
    cached_tokens_total: int
    transfer_address: str
    migrated_out: int
    migrated_in: int
    migration_fallbacks: int
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_capacity_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., book_live_seqs: _Optional[int] = ..., book_seq_slots: _Optional[int] = ..., reported_live_seqs: _Optional[int] = ..., reported_seq_slots: _Optional[int] = ..., kv_mismatches: _Optional[int] = ..., steps: _Optional[int] = ..., retractions: _Optional[int] = ..., wait_p50_s: _Optional[float] = ..., wait_p99_s: _Optional[float] = ..., wait_total_s: _Optional[float] = ..., step_total_s: _Optional[float] = ..., leaving: _Optional[bool] = ..., prompt_tokens_total: _Optional[int] = ..., cached_tokens_total: _Optional[int] = ..., transfer_address: _Optional[str] = ..., migrated_out: _Optional[int] = ..., migrated_in: _Optional[int] = ..., migration_fallbacks: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("model", "model_fingerprint", "max_context", "vocab_size", "workers", "kv_capacity_tokens", "queued", "running", "version", "model_path", "tenants")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_fingerprint: str
    max_context: int
    vocab_size: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    kv_capacity_tokens: int
    queued: int
    running: int
    version: str
    model_path: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantInfo]
    def __init__(self, model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., kv_capacity_tokens: _Optional[int] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., version: _Optional[str] = ..., model_path: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantInfo, _Mapping]]] = ...) -> None: ...

class TenantInfo(_message.Message):
    __slots__ = ("name", "requests", "rejected", "prompt_tokens", "output_tokens", "concurrent", "queued")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    name: str
    requests: int
    rejected: int
    prompt_tokens: int
    output_tokens: int
    concurrent: int
    queued: int
    def __init__(self, name: _Optional[str] = ..., requests: _Optional[int] = ..., rejected: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., concurrent: _Optional[int] = ..., queued: _Optional[int] = ...) -> None: ...
