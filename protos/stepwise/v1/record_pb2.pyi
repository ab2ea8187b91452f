from protos.stepwise.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Record(_message.Message):
    __slots__ = ("header", "add_request", "abort", "finish", "next_plan", "apply_result", "on_idle", "stats", "finished", "export", "import_kv", "send_kv", "spill_to")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ADD_REQUEST_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    NEXT_PLAN_FIELD_NUMBER: _ClassVar[int]
    APPLY_RESULT_FIELD_NUMBER: _ClassVar[int]
    ON_IDLE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FIELD_NUMBER: _ClassVar[int]
    IMPORT_KV_FIELD_NUMBER: _ClassVar[int]
    SEND_KV_FIELD_NUMBER: _ClassVar[int]
    SPILL_TO_FIELD_NUMBER: _ClassVar[int]
    header: Header
    add_request: AddRequestCall
    abort: AbortCall
    finish: FinishCall
    next_plan: NextPlanCall
    apply_result: ApplyResultCall
    on_idle: OnIdleCall
    stats: StepFigures
    finished: FinishedEvent
    export: ExportCall
    import_kv: ImportCall
    send_kv: SendKvCall
    spill_to: SpillCall
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., add_request: _Optional[_Union[AddRequestCall, _Mapping]] = ..., abort: _Optional[_Union[AbortCall, _Mapping]] = ..., finish: _Optional[_Union[FinishCall, _Mapping]] = ..., next_plan: _Optional[_Union[NextPlanCall, _Mapping]] = ..., apply_result: _Optional[_Union[ApplyResultCall, _Mapping]] = ..., on_idle: _Optional[_Union[OnIdleCall, _Mapping]] = ..., stats: _Optional[_Union[StepFigures, _Mapping]] = ..., finished: _Optional[_Union[FinishedEvent, _Mapping]] = ..., export: _Optional[_Union[ExportCall, _Mapping]] = ..., import_kv: _Optional[_Union[ImportCall, _Mapping]] = ..., send_kv: _Optional[_Union[SendKvCall, _Mapping]] = ..., spill_to: _Optional[_Union[SpillCall, _Mapping]] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("format_version", "scheduler_config_json", "worker", "seeds", "part", "first_step", "writer")
    class SeedsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    scheduler_config_json: str
    worker: _worker_pb2.Hello
    seeds: _containers.ScalarMap[str, int]
    part: int
    first_step: int
    writer: str
    def __init__(self, format_version: _Optional[int] = ..., scheduler_config_json: _Optional[str] = ..., worker: _Optional[_Union[_worker_pb2.Hello, _Mapping]] = ..., seeds: _Optional[_Mapping[str, int]] = ..., part: _Optional[int] = ..., first_step: _Optional[int] = ..., writer: _Optional[str] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("kind", "message", "code")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    code: str
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., code: _Optional[str] = ...) -> None: ...

class RequestParams(_message.Message):
    __slots__ = ("has_max_new_tokens", "max_new_tokens", "stop", "stop_token_ids", "ignore_eos", "sampler", "has_priority", "priority", "routing_key", "group", "sim_output_len", "min_new_tokens", "generated_before", "logprobs", "logprob_start_len", "tenant", "ttft_slo_ms", "tpot_slo_ms")
    HAS_MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    HAS_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SIM_OUTPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    has_max_new_tokens: bool
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    sampler: _worker_pb2.SamplerParams
    has_priority: bool
    priority: int
    routing_key: str
    group: str
    sim_output_len: int
    min_new_tokens: int
    generated_before: int
    logprobs: bool
    logprob_start_len: int
    tenant: str
    ttft_slo_ms: float
    tpot_slo_ms: float
    def __init__(self, has_max_new_tokens: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., sampler: _Optional[_Union[_worker_pb2.SamplerParams, _Mapping]] = ..., has_priority: _Optional[bool] = ..., priority: _Optional[int] = ..., routing_key: _Optional[str] = ..., group: _Optional[str] = ..., sim_output_len: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., generated_before: _Optional[int] = ..., logprobs: _Optional[bool] = ..., logprob_start_len: _Optional[int] = ..., tenant: _Optional[str] = ..., ttft_slo_ms: _Optional[float] = ..., tpot_slo_ms: _Optional[float] = ...) -> None: ...

class AddRequestCall(_message.Message):
    __slots__ = ("step", "rid", "input_ids", "params", "error", "at_s", "received_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    rid: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    params: RequestParams
    error: str
    at_s: float
    received_s: float
    def __init__(self, step: _Optional[int] = ..., rid: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[RequestParams, _Mapping]] = ..., error: _Optional[str] = ..., at_s: _Optional[float] = ..., received_s: _Optional[float] = ...) -> None: ...

class AbortCall(_message.Message):
    __slots__ = ("step", "rid", "reason", "applied")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    step: int
    rid: str
    reason: Outcome
    applied: bool
    def __init__(self, step: _Optional[int] = ..., rid: _Optional[str] = ..., reason: _Optional[_Union[Outcome, _Mapping]] = ..., applied: _Optional[bool] = ...) -> None: ...

class FinishCall(_message.Message):
    __slots__ = ("step", "rid", "reason", "applied")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    step: int
    rid: str
    reason: Outcome
    applied: bool
    def __init__(self, step: _Optional[int] = ..., rid: _Optional[str] = ..., reason: _Optional[_Union[Outcome, _Mapping]] = ..., applied: _Optional[bool] = ...) -> None: ...

class NextPlanCall(_message.Message):
    __slots__ = ("step", "plan", "has_plan", "kind", "always", "at_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    HAS_PLAN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ALWAYS_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    plan: _worker_pb2.StepPlan
    has_plan: bool
    kind: str
    always: bool
    at_s: float
    def __init__(self, step: _Optional[int] = ..., plan: _Optional[_Union[_worker_pb2.StepPlan, _Mapping]] = ..., has_plan: _Optional[bool] = ..., kind: _Optional[str] = ..., always: _Optional[bool] = ..., at_s: _Optional[float] = ...) -> None: ...

class ExportCall(_message.Message):
    __slots__ = ("step", "rid", "reason", "transfer_id", "address", "applied", "slots", "start")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    step: int
    rid: str
    reason: Outcome
    transfer_id: str
    address: str
    applied: bool
    slots: bytes
    start: int
    def __init__(self, step: _Optional[int] = ..., rid: _Optional[str] = ..., reason: _Optional[_Union[Outcome, _Mapping]] = ..., transfer_id: _Optional[str] = ..., address: _Optional[str] = ..., applied: _Optional[bool] = ..., slots: _Optional[bytes] = ..., start: _Optional[int] = ...) -> None: ...

class SendKvCall(_message.Message):
    __slots__ = ("step", "rid", "transfer_id", "address", "tokens")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    step: int
    rid: str
    transfer_id: str
    address: str
    tokens: int
    def __init__(self, step: _Optional[int] = ..., rid: _Optional[str] = ..., transfer_id: _Optional[str] = ..., address: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class SpillCall(_message.Message):
    __slots__ = ("step", "address", "tokens")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    step: int
    address: str
    tokens: int
    def __init__(self, step: _Optional[int] = ..., address: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class ImportCall(_message.Message):
    __slots__ = ("step", "transfer_id", "input_ids", "applied", "skip", "slots", "start", "hold")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    step: int
    transfer_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    applied: bool
    skip: int
    slots: bytes
    start: int
    hold: bool
    def __init__(self, step: _Optional[int] = ..., transfer_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., applied: _Optional[bool] = ..., skip: _Optional[int] = ..., slots: _Optional[bytes] = ..., start: _Optional[int] = ..., hold: _Optional[bool] = ...) -> None: ...

class ApplyResultCall(_message.Message):
    __slots__ = ("result", "at_s")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    result: _worker_pb2.StepResult
    at_s: float
    def __init__(self, result: _Optional[_Union[_worker_pb2.StepResult, _Mapping]] = ..., at_s: _Optional[float] = ...) -> None: ...

class OnIdleCall(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class StepFigures(_message.Message):
    __slots__ = ("step", "kind", "new_seqs", "new_tokens", "cached_tokens", "running_at_admission", "decode_bs", "queued", "pending_tokens", "new_token_ratio", "admission_ratio", "has_rem", "rem_total_tokens", "rem_input_tokens", "has_rem_chunk", "rem_chunk_tokens", "retracted", "retract_tokens_gained", "ratio_before_retract", "kv_full", "running", "kv_used", "kv_capacity")
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_AT_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    DECODE_BS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_RATIO_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    HAS_REM_FIELD_NUMBER: _ClassVar[int]
    REM_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REM_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_REM_CHUNK_FIELD_NUMBER: _ClassVar[int]
    REM_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRACTED_FIELD_NUMBER: _ClassVar[int]
    RETRACT_TOKENS_GAINED_FIELD_NUMBER: _ClassVar[int]
    RATIO_BEFORE_RETRACT_FIELD_NUMBER: _ClassVar[int]
    KV_FULL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    step: int
    kind: str
    new_seqs: int
    new_tokens: int
    cached_tokens: int
    running_at_admission: int
    decode_bs: int
    queued: int
    pending_tokens: int
    new_token_ratio: float
    admission_ratio: float
    has_rem: bool
    rem_total_tokens: float
    rem_input_tokens: int
    has_rem_chunk: bool
    rem_chunk_tokens: int
    retracted: _containers.RepeatedScalarFieldContainer[str]
    retract_tokens_gained: int
    ratio_before_retract: float
    kv_full: bool
    running: int
    kv_used: int
    kv_capacity: int
    def __init__(self, step: _Optional[int] = ..., kind: _Optional[str] = ..., new_seqs: _Optional[int] = ..., new_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., running_at_admission: _Optional[int] = ..., decode_bs: _Optional[int] = ..., queued: _Optional[int] = ..., pending_tokens: _Optional[int] = ..., new_token_ratio: _Optional[float] = ..., admission_ratio: _Optional[float] = ..., has_rem: _Optional[bool] = ..., rem_total_tokens: _Optional[float] = ..., rem_input_tokens: _Optional[int] = ..., has_rem_chunk: _Optional[bool] = ..., rem_chunk_tokens: _Optional[int] = ..., retracted: _Optional[_Iterable[str]] = ..., retract_tokens_gained: _Optional[int] = ..., ratio_before_retract: _Optional[float] = ..., kv_full: _Optional[bool] = ..., running: _Optional[int] = ..., kv_used: _Optional[int] = ..., kv_capacity: _Optional[int] = ...) -> None: ...

class FinishedEvent(_message.Message):
    __slots__ = ("step", "rid", "reason", "cached_tokens", "at_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    rid: str
    reason: Outcome
    cached_tokens: int
    at_s: float
    def __init__(self, step: _Optional[int] = ..., rid: _Optional[str] = ..., reason: _Optional[_Union[Outcome, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., at_s: _Optional[float] = ...) -> None: ...
