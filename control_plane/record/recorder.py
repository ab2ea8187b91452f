"""Recording a scheduler: a Scheduler whose mutating calls are also written, in order, to a sink.

RecordingScheduler is the Scheduler itself (the engine keeps reading its state as before) with
each mutating method wrapped: call, then record the call with its outcome. A sink decides where
entries go: a file (`stepwise control --record`), a timeline (`stepwise simulate`), or both.

Calls are recorded in the order they were made: under overlap scheduling plan N+1 comes before
result N, and replaying the calls in that order reproduces every plan. A request's `uid` is not
recorded (it only labels streamed tokens).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import structlog

from control_plane.config import ControlConfig, SchedulerConfig
from control_plane.record import codec
from control_plane.record.entries import (
    Abort,
    AddRequest,
    ApplyResult,
    Entry,
    Export,
    Finish,
    Finished,
    Header,
    ImportKv,
    NextPlan,
    OnIdle,
    SendKv,
    SpillTo,
    StepFigures,
)
from control_plane.record.files import RecordWriter, session_path
from control_plane.request import FinishReason, Request, RequestParams
from control_plane.scheduler.scheduler import QueueFull, RequestRejected, Scheduler, StepUpdates
from protos.worker import StepPlan, StepResult, WorkerLimits

log = structlog.get_logger("stepwise.record")


class Sink(Protocol):
    def write(self, entry: Entry) -> None: ...

    def end_step(self, step: int) -> None: ...

    def close(self) -> None: ...


class FileSink:
    """Entries encoded as delimited protobuf records into a rotating session of files.

    A recording is a debugging aid and never worth a request: the first write that fails (a full
    disk, a file-size limit, a directory gone) is logged once, the recording stops there, and the
    scheduler goes on serving. What was written before is a recording with a torn tail at worst,
    which the reader accepts.
    """

    def __init__(self, writer: RecordWriter) -> None:
        self.writer: RecordWriter | None = writer

    @property
    def stopped(self) -> bool:
        return self.writer is None

    def write(self, entry: Entry) -> None:
        if self.writer is not None:
            data = codec.encode(entry)
            self._guarded(lambda w: w.append(data))

    def end_step(self, step: int) -> None:
        self._guarded(lambda w: w.end_step(step))

    def close(self) -> None:
        self._guarded(lambda w: w.close())
        self.writer = None

    def _guarded(self, operation: Callable[[RecordWriter], None]) -> None:
        writer = self.writer
        if writer is None:
            return
        try:
            operation(writer)
        except OSError as exc:
            self.writer = None
            log.error(
                "recording stopped: a write failed; serving goes on", path=str(writer.path), error=str(exc)
            )
            with contextlib.suppress(OSError):
                writer.close()


class Tee:
    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = list(sinks)

    def write(self, entry: Entry) -> None:
        for sink in self.sinks:
            sink.write(entry)

    def end_step(self, step: int) -> None:
        for sink in self.sinks:
            sink.end_step(step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def recording_header(config: SchedulerConfig, limits: WorkerLimits, writer: str, **seeds: int) -> Header:
    return Header(config, limits, {"scheduler.random_seed": config.random_seed, **seeds}, writer=writer)


def open_file_sink(directory: Path, header: Header, max_bytes: int) -> FileSink:
    """A new session for this worker under `directory` (never appends to an earlier session).
    OSError when the session cannot be created."""
    return FileSink(RecordWriter(session_path(directory, header.limits.worker_id), header, max_bytes))


def _unstamped() -> float:
    return 0.0


class RecordingScheduler(Scheduler):
    """A Scheduler that writes every mutating call (and its outcome) to `sink`.

    `clock` stamps arrivals, plans, results and finishes (entries.py: `at_s`): a live control plane
    passes time.monotonic; a simulation passes none, so its recordings stay byte-for-byte the same."""

    def __init__(
        self,
        config: SchedulerConfig,
        limits: WorkerLimits,
        sink: Sink,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(config, limits)
        self.sink = sink
        self.clock = clock or _unstamped
        # rid -> when its call reached the frontend, until the request is added (note_received).
        self._received: dict[str, float] = {}

    def note_received(self, rid: str, received_s: float) -> None:
        """The frontend's arrival stamp of the call `rid` belongs to, for its AddRequest entry."""
        self._received[rid] = received_s

    def add_request(self, rid: str, input_ids: Sequence[int], params: RequestParams, uid: int = 0) -> Request:
        ids = tuple(input_ids)
        at_s, received_s = self.clock(), self._received.pop(rid, 0.0)
        try:
            req = super().add_request(rid, ids, params, uid)
        except (QueueFull, RequestRejected, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.sink.write(AddRequest(self.step_id, rid, ids, params, error, at_s, received_s))
            raise
        self.sink.write(AddRequest(self.step_id, rid, ids, params, "", at_s, received_s))
        return req

    def abort(self, rid: str, reason: FinishReason) -> bool:
        applied = super().abort(rid, reason)
        self.sink.write(Abort(self.step_id, rid, reason, applied))
        return applied

    def finish(self, rid: str, reason: FinishReason) -> bool:
        applied = super().finish(rid, reason)
        self.sink.write(Finish(self.step_id, rid, reason, applied))
        return applied

    def send_kv(self, rid: str, transfer_id: str, address: str) -> int:
        tokens = super().send_kv(rid, transfer_id, address)
        self.sink.write(SendKv(self.step_id, rid, transfer_id, address, tokens))
        return tokens

    def spill_to(self, address: str, tokens: int) -> None:
        super().spill_to(address, tokens)
        self.sink.write(SpillTo(self.step_id, address, tokens))

    def export(
        self, rid: str, reason: FinishReason, transfer_id: str, address: str, start: int = 0
    ) -> np.ndarray | None:
        slots = super().export(rid, reason, transfer_id, address, start)
        cached = None if slots is None else tuple(slots.tolist())
        self.sink.write(Export(self.step_id, rid, reason, transfer_id, address, cached, start))
        return slots

    def import_kv(
        self, transfer_id: str, input_ids: Sequence[int], start: int = 0, hold: bool = False
    ) -> tuple[int, np.ndarray] | None:
        ids = tuple(input_ids)
        outcome = super().import_kv(transfer_id, ids, start, hold)
        recorded = None if outcome is None else (outcome[0], tuple(outcome[1].tolist()))
        self.sink.write(ImportKv(self.step_id, transfer_id, ids, recorded, start, hold))
        return outcome

    def next_plan(self, always: bool = False) -> StepPlan | None:
        step, admission_ratio = self.step_id, self.ratio.current
        plan = super().next_plan(always)
        self.sink.write(NextPlan(step, plan, always, self.clock()))
        if plan is None:
            self.sink.end_step(self.step_id)
            return None
        assert self.last_stats is not None
        figures = StepFigures(
            self.last_stats, admission_ratio, self.live_handles(), self.kv.used_tokens(), self.capacity
        )
        self.sink.write(figures)
        return plan

    def apply_result(self, result: StepResult) -> None:
        at_s = self.clock()
        super().apply_result(result)
        self.sink.write(ApplyResult(result, at_s))
        self.sink.end_step(self.step_id)

    def on_idle(self) -> None:
        super().on_idle()
        self.sink.write(OnIdle(self.step_id))
        self.sink.end_step(self.step_id)

    def take_updates(self) -> StepUpdates:
        updates = super().take_updates()
        at_s = self.clock() if updates.finished else 0.0
        for f in updates.finished:
            self.sink.write(Finished(self.step_id, f.rid, f.reason, f.cached_tokens, at_s))
        return updates

    def close(self) -> None:
        self.sink.close()


def make_scheduler(config: ControlConfig, limits: WorkerLimits) -> Scheduler:
    """The engine's scheduler: a RecordingScheduler when --record DIR is set, else a plain one."""
    if config.record_dir is None:
        return Scheduler(config.scheduler, limits)
    header = recording_header(config.scheduler, limits, "stepwise control")
    try:
        sink = open_file_sink(config.record_dir, header, config.record_max_bytes)
    except OSError as exc:
        # The directory was checked at start; it can still fill up or go away since.
        log.error("recording not started: serving goes on", worker=limits.worker_id, error=str(exc))
        return Scheduler(config.scheduler, limits)
    return RecordingScheduler(config.scheduler, limits, sink, time.monotonic)


def note_received(scheduler: Scheduler, rid: str, received_s: float) -> None:
    """Under --record, the frontend's arrival stamp for `rid`'s AddRequest entry."""
    if isinstance(scheduler, RecordingScheduler):
        scheduler.note_received(rid, received_s)


def close_recording(scheduler: Scheduler) -> None:
    if isinstance(scheduler, RecordingScheduler):
        scheduler.close()
