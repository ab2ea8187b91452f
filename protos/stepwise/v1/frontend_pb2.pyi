from protos.stepwise.v1 import reports_pb2 as _reports_pb2
from protos.stepwise.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FrontendMessage(_message.Message):
    __slots__ = ("hello", "arrivals", "aborts", "stops", "queries", "pong")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ARRIVALS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    STOPS_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    hello: FrontendHello
    arrivals: _containers.RepeatedCompositeFieldContainer[Arrival]
    aborts: _containers.RepeatedCompositeFieldContainer[LinkAbort]
    stops: _containers.RepeatedCompositeFieldContainer[LinkStop]
    queries: _containers.RepeatedCompositeFieldContainer[Query]
    pong: Pong
    def __init__(self, hello: _Optional[_Union[FrontendHello, _Mapping]] = ..., arrivals: _Optional[_Iterable[_Union[Arrival, _Mapping]]] = ..., aborts: _Optional[_Iterable[_Union[LinkAbort, _Mapping]]] = ..., stops: _Optional[_Iterable[_Union[LinkStop, _Mapping]]] = ..., queries: _Optional[_Iterable[_Union[Query, _Mapping]]] = ..., pong: _Optional[_Union[Pong, _Mapping]] = ...) -> None: ...

class FrontendHello(_message.Message):
    __slots__ = ("index", "pid", "heartbeat_of")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_OF_FIELD_NUMBER: _ClassVar[int]
    index: int
    pid: int
    heartbeat_of: int
    def __init__(self, index: _Optional[int] = ..., pid: _Optional[int] = ..., heartbeat_of: _Optional[int] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("seq", "loop_silent_s")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LOOP_SILENT_S_FIELD_NUMBER: _ClassVar[int]
    seq: int
    loop_silent_s: float
    def __init__(self, seq: _Optional[int] = ..., loop_silent_s: _Optional[float] = ...) -> None: ...

class Arrival(_message.Message):
    __slots__ = ("request_id", "uids", "input_ids", "routing_key", "has_priority", "priority", "owner", "arrived", "prompt_field", "tenant", "ttft_slo_ms", "tpot_slo_ms", "authenticated", "params", "constraint_field")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    UIDS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    HAS_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    AUTHENTICATED_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    uids: _containers.RepeatedScalarFieldContainer[int]
    input_ids: bytes
    routing_key: str
    has_priority: bool
    priority: int
    owner: str
    arrived: float
    prompt_field: str
    tenant: str
    ttft_slo_ms: float
    tpot_slo_ms: float
    authenticated: bool
    params: CheckedParams
    constraint_field: str
    def __init__(self, request_id: _Optional[str] = ..., uids: _Optional[_Iterable[int]] = ..., input_ids: _Optional[bytes] = ..., routing_key: _Optional[str] = ..., has_priority: _Optional[bool] = ..., priority: _Optional[int] = ..., owner: _Optional[str] = ..., arrived: _Optional[float] = ..., prompt_field: _Optional[str] = ..., tenant: _Optional[str] = ..., ttft_slo_ms: _Optional[float] = ..., tpot_slo_ms: _Optional[float] = ..., authenticated: _Optional[bool] = ..., params: _Optional[_Union[CheckedParams, _Mapping]] = ..., constraint_field: _Optional[str] = ...) -> None: ...

class CheckedParams(_message.Message):
    __slots__ = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "ignore_eos", "sampler", "logprobs", "logprob_start_len")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    min_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    sampler: _worker_pb2.SamplerParams
    logprobs: bool
    logprob_start_len: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., sampler: _Optional[_Union[_worker_pb2.SamplerParams, _Mapping]] = ..., logprobs: _Optional[bool] = ..., logprob_start_len: _Optional[int] = ...) -> None: ...

class LinkAbort(_message.Message):
    __slots__ = ("request_id", "owner", "message", "cancelled", "query_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    owner: str
    message: str
    cancelled: bool
    query_id: int
    def __init__(self, request_id: _Optional[str] = ..., owner: _Optional[str] = ..., message: _Optional[str] = ..., cancelled: _Optional[bool] = ..., query_id: _Optional[int] = ...) -> None: ...

class LinkStop(_message.Message):
    __slots__ = ("uid", "stop")
    UID_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    uid: int
    stop: str
    def __init__(self, uid: _Optional[int] = ..., stop: _Optional[str] = ...) -> None: ...

class Query(_message.Message):
    __slots__ = ("query_id", "server_info")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_INFO_FIELD_NUMBER: _ClassVar[int]
    query_id: int
    server_info: _reports_pb2.GetServerInfoRequest
    def __init__(self, query_id: _Optional[int] = ..., server_info: _Optional[_Union[_reports_pb2.GetServerInfoRequest, _Mapping]] = ...) -> None: ...

class CoreMessage(_message.Message):
    __slots__ = ("welcome", "verdicts", "admissions", "token_uids", "token_ids", "finished", "replies", "state", "ping", "scored_tokens", "scores", "prompt_scores")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_UIDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    SCORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_SCORES_FIELD_NUMBER: _ClassVar[int]
    welcome: CoreWelcome
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    admissions: _containers.RepeatedCompositeFieldContainer[Admission]
    token_uids: bytes
    token_ids: bytes
    finished: _containers.RepeatedCompositeFieldContainer[LinkFinished]
    replies: _containers.RepeatedCompositeFieldContainer[Reply]
    state: CoreState
    ping: Ping
    scored_tokens: bytes
    scores: _containers.RepeatedCompositeFieldContainer[_reports_pb2.TokenLogprob]
    prompt_scores: _containers.RepeatedCompositeFieldContainer[LinkPromptScores]
    def __init__(self, welcome: _Optional[_Union[CoreWelcome, _Mapping]] = ..., verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., admissions: _Optional[_Iterable[_Union[Admission, _Mapping]]] = ..., token_uids: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., finished: _Optional[_Iterable[_Union[LinkFinished, _Mapping]]] = ..., replies: _Optional[_Iterable[_Union[Reply, _Mapping]]] = ..., state: _Optional[_Union[CoreState, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., scored_tokens: _Optional[bytes] = ..., scores: _Optional[_Iterable[_Union[_reports_pb2.TokenLogprob, _Mapping]]] = ..., prompt_scores: _Optional[_Iterable[_Union[LinkPromptScores, _Mapping]]] = ...) -> None: ...

class LinkPromptScores(_message.Message):
    __slots__ = ("uid", "start", "positions")
    UID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    uid: int
    start: int
    positions: _containers.RepeatedCompositeFieldContainer[_reports_pb2.TokenLogprob]
    def __init__(self, uid: _Optional[int] = ..., start: _Optional[int] = ..., positions: _Optional[_Iterable[_Union[_reports_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class CoreWelcome(_message.Message):
    __slots__ = ("link_id",)
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    link_id: int
    def __init__(self, link_id: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("uid", "code", "message", "retry_after_s")
    UID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    uid: int
    code: int
    message: str
    retry_after_s: float
    def __init__(self, uid: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class Admission(_message.Message):
    __slots__ = ("uid", "cached_tokens", "admitted", "worker")
    UID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    uid: int
    cached_tokens: int
    admitted: float
    worker: str
    def __init__(self, uid: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., admitted: _Optional[float] = ..., worker: _Optional[str] = ...) -> None: ...

class LinkFinished(_message.Message):
    __slots__ = ("uid", "kind", "message", "code", "cached_tokens")
    UID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    uid: int
    kind: str
    message: str
    code: str
    cached_tokens: int
    def __init__(self, uid: _Optional[int] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., code: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("query_id", "server_info", "abort")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_INFO_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    query_id: int
    server_info: _reports_pb2.ServerInfo
    abort: _reports_pb2.AbortResponse
    def __init__(self, query_id: _Optional[int] = ..., server_info: _Optional[_Union[_reports_pb2.ServerInfo, _Mapping]] = ..., abort: _Optional[_Union[_reports_pb2.AbortResponse, _Mapping]] = ...) -> None: ...

class CoreState(_message.Message):
    __slots__ = ("workers", "max_context", "vocab_size", "draining")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    workers: int
    max_context: int
    vocab_size: int
    draining: bool
    def __init__(self, workers: _Optional[int] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...
