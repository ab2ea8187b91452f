"""What a recording holds, as typed values: a header, then every mutating scheduler call in order.

Replaying the calls (AddRequest, Abort, Finish, NextPlan, ApplyResult, OnIdle, SendKv, SpillTo, Export,
ImportKv) into a fresh
Scheduler built from the header must reproduce every recorded plan. StepFigures and Finished are
observations for `stepwise replay show`; scheduler replay also checks the finishes.

`step` on a call is the number of plans the scheduler had made when it was called: an arrival
stamped 4 is first seen by plan 5.

`at_s` (and an arrival's `received_s`) are timing stamps on the control plane's clock
(CLOCK_MONOTONIC seconds, the clock the frontend stamps a call's arrival with), written by a live
control plane's recorder for `stepwise simulate --fit-cost` (docs/debugging.md#step-cost-models);
0.0 where nothing was stamped (a simulation's recording, or one made before the stamps). Replay
ignores them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from control_plane.config import SchedulerConfig
from control_plane.request import FinishReason, RequestParams
from control_plane.scheduler.scheduler import StepStats
from protos.worker import StepPlan, StepResult, WorkerLimits

FORMAT_VERSION = 2


@dataclass(frozen=True, slots=True)
class Header:
    scheduler: SchedulerConfig
    limits: WorkerLimits
    # Seeds that decisions or tokens depend on, by name ("scheduler.random_seed", "sim.seed").
    seeds: Mapping[str, int] = field(default_factory=dict)
    # 0 for a session's first file; k for its k-th continuation.
    part: int = 0
    # Steps planned before this part began.
    first_step: int = 0
    writer: str = ""
    format_version: int = FORMAT_VERSION


@dataclass(frozen=True, slots=True)
class AddRequest:
    step: int
    rid: str
    input_ids: tuple[int, ...]
    params: RequestParams
    # "" when accepted, else "ExceptionName: message".
    error: str = ""
    # When the scheduler got the request, and when the frontend received its call.
    at_s: float = 0.0
    received_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Abort:
    step: int
    rid: str
    reason: FinishReason
    applied: bool


@dataclass(frozen=True, slots=True)
class Finish:
    """A finish decided by the engine (a stop string)."""

    step: int
    rid: str
    reason: FinishReason
    applied: bool


@dataclass(frozen=True, slots=True)
class NextPlan:
    step: int
    plan: StepPlan | None
    # next_plan(always=True): a plan even with nothing to do.
    always: bool = False
    # When the plan was made.
    at_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ApplyResult:
    result: StepResult
    # When the control plane applied it (the result had just come back).
    at_s: float = 0.0


@dataclass(frozen=True, slots=True)
class OnIdle:
    step: int


@dataclass(frozen=True, slots=True)
class SendKv:
    """A migration's pre-copy of a running request's KV (docs/migration.md)."""

    step: int
    rid: str
    transfer_id: str
    address: str
    # What the call returned: the positions sent.
    tokens: int


@dataclass(frozen=True, slots=True)
class SpillTo:
    """Where a retraction sends requests instead, with their KV (docs/migration.md#balancing)."""

    step: int
    address: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Export:
    """A running request finished here to continue on another worker (docs/migration.md)."""

    step: int
    rid: str
    reason: FinishReason
    transfer_id: str
    address: str
    # What the call returned: None when it did not apply, else the slots of the cached part.
    slots: tuple[int, ...] | None
    start: int = 0


@dataclass(frozen=True, slots=True)
class ImportKv:
    """KV another worker sent, given a place in the prefix cache (docs/migration.md); no
    input_ids: the transfer is forgotten."""

    step: int
    transfer_id: str
    input_ids: tuple[int, ...]
    # What the call returned: None when there was no room, else (skip, slots).
    outcome: tuple[int, tuple[int, ...]] | None
    start: int = 0
    hold: bool = False


@dataclass(frozen=True, slots=True)
class StepFigures:
    """A planned step's StepStats plus what the stats do not carry."""

    stats: StepStats
    # The new-token ratio admission used (StepStats.new_token_ratio is the value after a retraction).
    admission_ratio: float
    # Sequences live on the worker during this step.
    running: int
    kv_used: int
    kv_capacity: int


@dataclass(frozen=True, slots=True)
class Finished:
    """A finish the engine took from the scheduler and published."""

    step: int
    rid: str
    reason: FinishReason
    cached_tokens: int = 0
    # When the engine published it.
    at_s: float = 0.0


Call = AddRequest | Abort | Finish | NextPlan | ApplyResult | OnIdle | SendKv | SpillTo | Export | ImportKv
Entry = Header | Call | StepFigures | Finished
