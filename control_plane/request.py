"""A request's life in the control plane: parameters (frozen) and scheduling state (mutable).

Field names follow SGLang's `Req` (SCHEDULER.md §0.1) so that the scheduler code reads like the
specification: `origin_input_ids`, `output_ids`, `prefix_indices`, `last_node`,
`cache_protected_len`, `kv_committed_len`, `extend_range`, `is_retracted`, ...
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

EMPTY_SLOTS = np.zeros(0, dtype=np.int64)


class FinishKind(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


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
class SamplerSpec:
    """How the worker samples for one sequence (mirrors the worker protocol's SamplerParams)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    logprobs: int = 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass(frozen=True, slots=True)
class RequestParams:
    """What the client asked for; never changes after intake."""

    max_new_tokens: int | None = None
    # Stop conditions (EOS, stop token ids, stop strings) are ignored until this many tokens (§1.5).
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    sampler: SamplerSpec = SamplerSpec()
    priority: int | None = None
    routing_key: str = ""
    # Parallel-sample group (n > 1): members are retracted together or not at all.
    group: str = ""
    # Sim backend only: output tokens before EOS (0: the backend's seeded rule).
    sim_output_len: int = 0


@dataclass(slots=True, eq=False)
class Request:
    """One generation as the scheduler sees it.

    Positions [0, kv_committed_len) have KV on the worker (slot ids in the request's row of the
    request-to-token table); `prefix_indices` are the slots reused for [0, len(prefix_indices)) in the
    current extend; `extend_range` is the half-open range computed by the current extend.
    """

    rid: str
    origin_input_ids: list[int]
    params: RequestParams
    # Order of arrival (a logical clock, never the wall clock: decisions must replay exactly).
    max_new_tokens: int = 0
    # params.min_new_tokens lowered to max_new_tokens when larger (§1.5).
    min_new_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    # Scheduling state (SCHEDULER.md §0.1).
    handle: int = -1
    req_pool_idx: int = -1
    prefix_indices: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)
    last_node: Any = None
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    extend_range: tuple[int, int] = (0, 0)
    num_matched_prefix_tokens: int = 0
    inflight_middle_chunks: int = 0
    wait_queue_entry_time: int = 0
    is_retracted: bool = False
    retracted_stain: bool = False
    retraction_count: int = 0
    finished_reason: FinishReason | None = None
    # Usage: prompt tokens served from the prefix cache at first admission.
    cached_tokens: int = 0
    # Effective priority: the client's, or the least important value when priority scheduling is
    # on and none was given (SCHEDULER.md §1.5).
    priority: int | None = None
    # Positions whose KV waits in the worker's host backup pool (under `handle`) since a retraction.
    host_backup_len: int = 0
    # Set when priority preemption picked this request in the current pass.
    preempted: bool = False
    # Prompt + outputs as int64, kept in step with output_ids: the prefix tree keys on these bytes,
    # and converting a Python list of 2k ids costs ~36 µs per match (an array slice: ~0.6 µs).
    _fill: array = field(default_factory=lambda: array("q"))

    @property
    def fill_ids(self) -> array:
        """Prompt plus generated tokens: what a (re-)prefill must cover. Do not mutate."""
        if len(self._fill) != len(self.origin_input_ids) + len(self.output_ids):
            self._fill = array("q", self.origin_input_ids + self.output_ids)
        return self._fill

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        if self._fill:  # once built, kept in step; fill_ids rebuilds it if it ever falls behind
            self._fill.append(token)

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def finish(self, reason: FinishReason) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason
