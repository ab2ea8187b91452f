from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
