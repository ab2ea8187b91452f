"""A request's life in the control plane: parameters (frozen) and scheduling state (mutable).

Field names follow SGLang's `Req` (docs/scheduler.md#data-model) so that the scheduler code reads like the
specification: `origin_input_ids`, `output_ids`, `prefix_indices`, `last_node`,
`cache_protected_len`, `kv_committed_len`, `extend_range`, `is_retracted`, ...
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from protos.worker import SamplerParams

EMPTY_SLOTS = np.zeros(0, dtype=np.int64)


class FinishKind(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # The output's grammar reached a state no token goes on from and that is no complete sentence
    # (the worker's matcher failed): the output ended there, matching no sentence of the grammar.
    GRAMMAR_UNSATISFIABLE = "grammar_unsatisfiable"


class AbortCode(enum.Enum):
    """Why an abort happened, mapped to a gRPC status by the server when it ends a stream."""

    CANCELLED = "cancelled"  # the client went away or called Abort
    UNAVAILABLE = "unavailable"  # queue full, preempted by priority, timeout, worker lost (SGLang: 503)
    INTERNAL = "internal"  # out of memory even after retraction (SGLang: 500)
    INVALID = "invalid"  # rejected input (SGLang: 400)


@dataclass(frozen=True, slots=True)
class FinishReason:
    kind: FinishKind
    message: str = ""
    code: AbortCode | None = None

    @staticmethod
    def stop(message: str) -> FinishReason:
        return FinishReason(FinishKind.STOP, message)

    @staticmethod
    def length(message: str) -> FinishReason:
        return FinishReason(FinishKind.LENGTH, message)

    @staticmethod
    def abort(message: str, code: AbortCode = AbortCode.UNAVAILABLE) -> FinishReason:
        return FinishReason(FinishKind.ABORT, message, code)


@dataclass(frozen=True, slots=True)
class RequestParams:
    """What the client asked for; never changes after intake."""

    max_new_tokens: int | None = None
    # Stop conditions (EOS, stop token ids, stop strings) are ignored until this many tokens
    # (docs/scheduler.md#intake).
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # Greedy unless set: the client protocol's defaults (temperature 1.0) are
    # control_plane/frontend/client_codec.py's.
    sampler: SamplerParams = SamplerParams()
    priority: int | None = None
    routing_key: str = ""
    # Parallel-sample group (n > 1): members are retracted together or not at all.
    group: str = ""
    # Sim backend only: output tokens before EOS (0: the backend's seeded rule).
    sim_output_len: int = 0
    # Tokens at the end of the input that an earlier worker generated: a request continued after a
    # hand-over. The client's prompt is the input less these; the worker is told the client's prompt
    # length, so what depends on it (the sim's EOS position) does not move with a re-prefill.
    generated_before: int = 0
    # Output tokens carry their log probabilities (the sampler's `logprobs` says how many top ones).
    logprobs: bool = False
    # Prompt positions from here on are scored (SGLang's logprob_start_len); -1: none
    # (docs/scheduler.md#prompt-log-probabilities).
    logprob_start_len: int = -1
    # Whose request this is (docs/deploy.md#tenants, docs/scheduler.md#fairness): the core's
    # resolution of the caller's key and the client's `tenant` field; "" without either, a tenant
    # like any other to fairness.
    tenant: str = ""
    # Latency objectives in milliseconds (docs/scheduler.md#slo-admission); 0: none.
    ttft_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0


class RowColumns(Protocol):
    """Where a request's per-step state lives while it holds a request row (the scheduler's
    control_plane/scheduler/columns.py): the columns are authoritative then, not the Request."""

    committed: np.ndarray
    allocated: np.ndarray
    n_out: np.ndarray

    def sync(self, req: Request) -> None: ...

    def append_one(self, req: Request, token: int) -> None: ...


@dataclass(slots=True, eq=False)
class Request:
    """One generation as the scheduler sees it.

    Positions [0, kv_committed_len) have KV on the worker (slot ids in the request's row of the
    request-to-token table), positions [0, kv_allocated_len) have a slot (more than committed while a
    decode planned for it is in flight); `prefix_indices` are the slots reused for
    [0, len(prefix_indices)) in the current extend; `extend_range` is the half-open range computed by
    the current extend.

    While the request holds a row its lengths and generated tokens live in the scheduler's columns
    (`bind_columns`): `kv_committed_len` and `kv_allocated_len` read and write them, and `output_ids`
    first materialises the tokens applied since the last read. Once the row is released, the fields
    here are authoritative again.
    """

    rid: str
    origin_input_ids: list[int]
    params: RequestParams
    # Order of arrival (a logical clock, never the wall clock: decisions must replay exactly).
    max_new_tokens: int = 0
    # params.min_new_tokens lowered to max_new_tokens when larger (docs/scheduler.md#intake).
    min_new_tokens: int = 0
    # The engine's key for this request's stream (unsigned 64-bit), carried into token output only:
    # never a scheduling input, not recorded.
    uid: int = 0
    # Scheduling state (docs/scheduler.md#data-model).
    handle: int = -1
    req_pool_idx: int = -1
    prefix_indices: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)
    last_node: Any = None
    cache_protected_len: int = 0
    extend_range: tuple[int, int] = (0, 0)
    num_matched_prefix_tokens: int = 0
    # SGLang's len(full_untruncated_fill_ids): prompt plus outputs as they were when the request was
    # last matched for admission or last decoded in a mixed step; 0 before its first match, and not
    # reset by a retraction or preemption (docs/scheduler.md#priority-preemption reckons from it).
    matched_fill_len: int = 0
    inflight_middle_chunks: int = 0
    wait_queue_entry_time: int = 0
    # The queue clock at the latest entry into the waiting queue (queue_clock.py): seconds of
    # worker time and prefill tokens computed.
    queue_entry_s: float = 0.0
    queue_entry_tokens: int = 0
    # LPM's sort key from the kept matches past 128 waiting (scheduler/queue_matches.py).
    queue_key: float = 0.0
    is_retracted: bool = False
    retracted_stain: bool = False
    retraction_count: int = 0
    finished_reason: FinishReason | None = None
    # SGLang's to_finish: an abort of a request that holds its KV past its prefill's planning only marks
    # it; it ends at its next result, its KV cached, with this reason (docs/scheduler.md#aborts). Its
    # finish was published when it was marked.
    to_finish: FinishReason | None = None
    # Usage: prompt tokens served from the prefix cache at first admission.
    cached_tokens: int = 0
    # Effective priority: the client's, or the least important value when priority scheduling is
    # on and none was given (docs/scheduler.md#intake).
    priority: int | None = None
    # Positions whose KV waits in the worker's host backup pool (under `handle`) since a retraction.
    host_backup_len: int = 0
    # Set when priority preemption picked this request in the current pass.
    preempted: bool = False
    # What kv_committed_len and kv_allocated_len hold while no columns are bound.
    _kv_committed_len: int = 0
    _kv_allocated_len: int = 0
    _columns: RowColumns | None = field(default=None, repr=False)
    # Prompt scoring (params.logprob_start_len >= 0): the rows received so far, in position order
    # (row p scores position p against token p + 1), the next position a plan is to score, and
    # whether the whole prompt's scores were published (then nothing more is scored).
    score_rows: list[Any] = field(default_factory=list)
    score_next: int = 0
    scores_sent: bool = False
    # Generated tokens live in `_fill` (prompt + outputs as int64: the prefix tree keys on these
    # bytes, and converting a Python list of 2k ids costs ~36 µs per match, an array slice ~0.6 µs)
    # and, as Python ints, in `_output_ids`, which is extended from `_fill` only when read: a Python
    # int per token is the expensive part. `_num_outputs` counts them; while `_fill` is not built,
    # `_output_ids` holds them all.
    _output_ids: list[int] = field(default_factory=list)
    _num_outputs: int = 0
    _fill: array = field(default_factory=lambda: array("q"))

    # --- the state that lives in the columns while the request holds a row ---------------------

    def bind_columns(self, columns: RowColumns | None) -> None:
        """For the columns only: from now on (None: no longer) they hold this request's state."""
        self._columns = columns

    @property
    def output_ids(self) -> list[int]:
        """Generated tokens, append-only. Do not mutate the list. Costs a Python int per token not
        read before: prefer `num_outputs` for the count and `fill_ids` for the ids."""
        if self._columns is not None:
            self._columns.sync(self)
        missing = self._num_outputs - len(self._output_ids)
        if missing:
            self._output_ids.extend(self._fill[len(self._fill) - missing :])
        return self._output_ids

    @output_ids.setter
    def output_ids(self, ids: list[int]) -> None:
        if self._columns is not None:
            raise RuntimeError(f"{self.rid}: output_ids are the columns' while the request holds a row")
        self._output_ids = list(ids)
        self._num_outputs = len(self._output_ids)
        self._fill = array("q")

    @property
    def num_outputs(self) -> int:
        """len(output_ids), without building the list."""
        columns = self._columns
        return int(columns.n_out[self.req_pool_idx]) if columns is not None else self._num_outputs

    @property
    def kv_committed_len(self) -> int:
        columns = self._columns
        return int(columns.committed[self.req_pool_idx]) if columns is not None else self._kv_committed_len

    @kv_committed_len.setter
    def kv_committed_len(self, n: int) -> None:
        if self._columns is not None:
            self._columns.committed[self.req_pool_idx] = n
        else:
            self._kv_committed_len = n

    @property
    def kv_allocated_len(self) -> int:
        columns = self._columns
        return int(columns.allocated[self.req_pool_idx]) if columns is not None else self._kv_allocated_len

    @kv_allocated_len.setter
    def kv_allocated_len(self, n: int) -> None:
        if self._columns is not None:
            self._columns.allocated[self.req_pool_idx] = n
        else:
            self._kv_allocated_len = n

    def extend_output(self, tokens: np.ndarray) -> None:
        """For the columns' sync (and detached requests) only: append generated token ids (int)."""
        fill = self.fill_ids
        fill.frombytes(tokens.astype(np.int64).tobytes())
        self._num_outputs += len(tokens)

    # --- derived ---------------------------------------------------------------------------------

    @property
    def fill_ids(self) -> array:
        """Prompt plus generated tokens: what a (re-)prefill must cover. Do not mutate."""
        if self._columns is not None:
            self._columns.sync(self)
        if len(self._fill) != len(self.origin_input_ids) + self._num_outputs:
            self._fill = array("q", self.origin_input_ids + self.output_ids)
        return self._fill

    def append_output(self, token: int) -> None:
        if self._columns is not None:
            self._columns.append_one(self, token)
        else:
            self.extend_output(np.array([token], dtype=np.int64))

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + self.num_outputs

    @property
    def scores_pending(self) -> bool:
        """Prompt positions still to be scored and published (docs/scheduler.md#prompt-log-probabilities)."""
        return self.params.logprob_start_len >= 0 and not self.scores_sent

    @property
    def score_rows_wanted(self) -> int:
        """Rows the prompt scoring needs: positions logprob_start_len .. prompt end - 2 (each scores
        the token after it; the last prompt position's row is the first output token's)."""
        return max(0, len(self.origin_input_ids) - 1 - self.params.logprob_start_len)

    @property
    def score_received_to(self) -> int:
        """The first prompt position whose row has not been received."""
        return self.params.logprob_start_len + len(self.score_rows)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def finish(self, reason: FinishReason) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason
