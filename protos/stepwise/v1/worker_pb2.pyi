from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "result", "drain", "received", "grammar_ready")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_READY_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    result: StepResult
    drain: Drain
    received: TransferOutcome
    grammar_ready: GrammarReady
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., received: _Optional[_Union[TransferOutcome, _Mapping]] = ..., grammar_ready: _Optional[_Union[GrammarReady, _Mapping]] = ...) -> None: ...

class ControlMessage(_message.Message):
    __slots__ = ("welcome", "plan", "shutdown", "move", "dropped", "prepare")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    plan: StepPlan
    shutdown: Shutdown
    move: Move
    dropped: Dropped
    prepare: Grammar
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., plan: _Optional[_Union[StepPlan, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., move: _Optional[_Union[Move, _Mapping]] = ..., dropped: _Optional[_Union[Dropped, _Mapping]] = ..., prepare: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class GrammarReady(_message.Message):
    __slots__ = ("grammar", "error")
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    grammar: Grammar
    error: str
    def __init__(self, grammar: _Optional[_Union[Grammar, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Move(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Dropped(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class CensusRequest(_message.Message):
    __slots__ = ("hello",)
    HELLO_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ...) -> None: ...

class CensusReply(_message.Message):
    __slots__ = ("control_plane_id", "workers", "queued", "running", "accepting", "model_fingerprint", "hello_judged", "refusal")
    CONTROL_PLANE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    ACCEPTING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HELLO_JUDGED_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    control_plane_id: str
    workers: int
    queued: int
    running: int
    accepting: bool
    model_fingerprint: str
    hello_judged: bool
    refusal: str
    def __init__(self, control_plane_id: _Optional[str] = ..., workers: _Optional[int] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., accepting: _Optional[bool] = ..., model_fingerprint: _Optional[str] = ..., hello_judged: _Optional[bool] = ..., refusal: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("worker_id", "model_fingerprint", "kv_capacity_tokens", "page_size", "max_context", "vocab_size", "dtype", "device", "protocol_version", "eos_token_ids", "host_pool_capacity_tokens", "grammar_backends", "transfer_address", "role", "prepares_grammars")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_POOL_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREPARES_GRAMMARS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_fingerprint: str
    kv_capacity_tokens: int
    page_size: int
    max_context: int
    vocab_size: int
    dtype: str
    device: str
    protocol_version: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    host_pool_capacity_tokens: int
    grammar_backends: _containers.RepeatedScalarFieldContainer[str]
    transfer_address: str
    role: str
    prepares_grammars: bool
    def __init__(self, worker_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., kv_capacity_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., protocol_version: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., host_pool_capacity_tokens: _Optional[int] = ..., grammar_backends: _Optional[_Iterable[str]] = ..., transfer_address: _Optional[str] = ..., role: _Optional[str] = ..., prepares_grammars: _Optional[bool] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("accepted", "reason", "retryable", "transfer_reports")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_REPORTS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    retryable: bool
    transfer_reports: bool
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., retryable: _Optional[bool] = ..., transfer_reports: _Optional[bool] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SamplerParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "has_seed", "seed", "logprobs", "logit_bias", "token_ids_logprob", "processed_logprobs", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    has_seed: bool
    seed: int
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    token_ids_logprob: _containers.RepeatedScalarFieldContainer[int]
    processed_logprobs: bool
    grammar: Grammar
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., token_ids_logprob: _Optional[_Iterable[int]] = ..., processed_logprobs: _Optional[bool] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("backend", "kind", "spec")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    backend: str
    kind: str
    spec: str
    def __init__(self, backend: _Optional[str] = ..., kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("handle", "sampler", "prefix_slots", "history_ids", "request_id", "sim_output_len", "prompt_len")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SIM_OUTPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    handle: int
    sampler: SamplerParams
    prefix_slots: bytes
    history_ids: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    sim_output_len: int
    prompt_len: int
    def __init__(self, handle: _Optional[int] = ..., sampler: _Optional[_Union[SamplerParams, _Mapping]] = ..., prefix_slots: _Optional[bytes] = ..., history_ids: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., sim_output_len: _Optional[int] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class ExtendBatch(_message.Message):
    __slots__ = ("handles", "starts", "lens", "sample", "token_ids", "slots", "score_starts", "score_lens", "next_ids")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    LENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SCORE_STARTS_FIELD_NUMBER: _ClassVar[int]
    SCORE_LENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[int]
    starts: _containers.RepeatedScalarFieldContainer[int]
    lens: _containers.RepeatedScalarFieldContainer[int]
    sample: _containers.RepeatedScalarFieldContainer[bool]
    token_ids: bytes
    slots: bytes
    score_starts: _containers.RepeatedScalarFieldContainer[int]
    score_lens: _containers.RepeatedScalarFieldContainer[int]
    next_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handles: _Optional[_Iterable[int]] = ..., starts: _Optional[_Iterable[int]] = ..., lens: _Optional[_Iterable[int]] = ..., sample: _Optional[_Iterable[bool]] = ..., token_ids: _Optional[bytes] = ..., slots: _Optional[bytes] = ..., score_starts: _Optional[_Iterable[int]] = ..., score_lens: _Optional[_Iterable[int]] = ..., next_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeBatch(_message.Message):
    __slots__ = ("count", "full", "left", "joined", "run_entries", "run_slots", "run_lens")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    RUN_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RUN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUN_LENS_FIELD_NUMBER: _ClassVar[int]
    count: int
    full: _containers.RepeatedScalarFieldContainer[int]
    left: _containers.RepeatedScalarFieldContainer[int]
    joined: _containers.RepeatedScalarFieldContainer[int]
    run_entries: _containers.RepeatedScalarFieldContainer[int]
    run_slots: _containers.RepeatedScalarFieldContainer[int]
    run_lens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, count: _Optional[int] = ..., full: _Optional[_Iterable[int]] = ..., left: _Optional[_Iterable[int]] = ..., joined: _Optional[_Iterable[int]] = ..., run_entries: _Optional[_Iterable[int]] = ..., run_slots: _Optional[_Iterable[int]] = ..., run_lens: _Optional[_Iterable[int]] = ...) -> None: ...

class KvTransfer(_message.Message):
    __slots__ = ("handle", "slots")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    slots: bytes
    def __init__(self, handle: _Optional[int] = ..., slots: _Optional[bytes] = ...) -> None: ...

class SlotRemap(_message.Message):
    __slots__ = ("handle", "start", "slots")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    start: int
    slots: bytes
    def __init__(self, handle: _Optional[int] = ..., start: _Optional[int] = ..., slots: _Optional[bytes] = ...) -> None: ...

class KvSend(_message.Message):
    __slots__ = ("transfer_id", "address", "slots")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    address: str
    slots: bytes
    def __init__(self, transfer_id: _Optional[str] = ..., address: _Optional[str] = ..., slots: _Optional[bytes] = ...) -> None: ...

class KvReceive(_message.Message):
    __slots__ = ("transfer_id", "slots", "skip")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    slots: bytes
    skip: int
    def __init__(self, transfer_id: _Optional[str] = ..., slots: _Optional[bytes] = ..., skip: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "release_handles", "offloads", "restores", "new_seqs", "extends", "decodes", "remaps", "reset", "sends", "receives")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    EXTENDS_FIELD_NUMBER: _ClassVar[int]
    DECODES_FIELD_NUMBER: _ClassVar[int]
    REMAPS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    SENDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    release_handles: _containers.RepeatedScalarFieldContainer[int]
    offloads: _containers.RepeatedCompositeFieldContainer[KvTransfer]
    restores: _containers.RepeatedCompositeFieldContainer[KvTransfer]
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSequence]
    extends: ExtendBatch
    decodes: DecodeBatch
    remaps: _containers.RepeatedCompositeFieldContainer[SlotRemap]
    reset: bool
    sends: _containers.RepeatedCompositeFieldContainer[KvSend]
    receives: _containers.RepeatedCompositeFieldContainer[KvReceive]
    def __init__(self, step_id: _Optional[int] = ..., release_handles: _Optional[_Iterable[int]] = ..., offloads: _Optional[_Iterable[_Union[KvTransfer, _Mapping]]] = ..., restores: _Optional[_Iterable[_Union[KvTransfer, _Mapping]]] = ..., new_seqs: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., extends: _Optional[_Union[ExtendBatch, _Mapping]] = ..., decodes: _Optional[_Union[DecodeBatch, _Mapping]] = ..., remaps: _Optional[_Iterable[_Union[SlotRemap, _Mapping]]] = ..., reset: _Optional[bool] = ..., sends: _Optional[_Iterable[_Union[KvSend, _Mapping]]] = ..., receives: _Optional[_Iterable[_Union[KvReceive, _Mapping]]] = ...) -> None: ...

class KvReport(_message.Message):
    __slots__ = ("live_seqs", "seq_slots", "capacity_tokens", "device_mem_used_bytes", "host_seqs")
    LIVE_SEQS_FIELD_NUMBER: _ClassVar[int]
    SEQ_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_SEQS_FIELD_NUMBER: _ClassVar[int]
    live_seqs: int
    seq_slots: int
    capacity_tokens: int
    device_mem_used_bytes: int
    host_seqs: int
    def __init__(self, live_seqs: _Optional[int] = ..., seq_slots: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., device_mem_used_bytes: _Optional[int] = ..., host_seqs: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs", "ids_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IDS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ids_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., ids_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptScores(_message.Message):
    __slots__ = ("entry", "rows")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    entry: int
    rows: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, entry: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TransferOutcome(_message.Message):
    __slots__ = ("transfer_id", "error", "bytes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    error: str
    bytes: int
    def __init__(self, transfer_id: _Optional[str] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "token_ids", "logprobs", "prompt_scores", "kv", "forward_s", "error", "wait_s", "transfers", "grammar_failed")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_SCORES_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FAILED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    token_ids: bytes
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_scores: _containers.RepeatedCompositeFieldContainer[PromptScores]
    kv: KvReport
    forward_s: float
    error: str
    wait_s: float
    transfers: _containers.RepeatedCompositeFieldContainer[TransferOutcome]
    grammar_failed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_scores: _Optional[_Iterable[_Union[PromptScores, _Mapping]]] = ..., kv: _Optional[_Union[KvReport, _Mapping]] = ..., forward_s: _Optional[float] = ..., error: _Optional[str] = ..., wait_s: _Optional[float] = ..., transfers: _Optional[_Iterable[_Union[TransferOutcome, _Mapping]]] = ..., grammar_failed: _Optional[_Iterable[int]] = ...) -> None: ...
