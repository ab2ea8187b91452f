"""Faults, contained where they arise: a lost worker's requests continue on another worker from
their last streamed token, and a fault of our own restarts this worker's scheduler (STYLE: a loop
that serves everyone never dies of one exception)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from control_plane.config import ControlConfig
from control_plane.record.recorder import close_recording, make_scheduler
from control_plane.request import FinishReason, Request
from control_plane.scheduler.plan import WorkerLimits
from control_plane.scheduler.scheduler import QueueFull, RequestRejected
from control_plane.streams import INTERNAL_ERROR, AbortItem, Arrival, Orphan, Publishing, RequestStream

if TYPE_CHECKING:
    from control_plane.engine import Engine

# A request live during this many faults of our own is ended rather than tried again.
MAX_FAULTS_PER_REQUEST = 2
# This many faults in a row, with no step completed between them, and the worker is given up.
MAX_CONSECUTIVE_FAULTS = 3


class WorkerGone(Exception):
    """The worker's stream ended or broke."""


class Failover(Publishing):
    """Hand-over of a lost worker's requests and recovery from our own faults (part of the Engine)."""

    config: ControlConfig
    limits: WorkerLimits
    _inbox: list[Arrival | AbortItem | Orphan]
    successor: Callable[[Engine], Engine | None] | None
    _reset_worker: bool
    _faults_in_a_row: int
    _pool_dirty: bool

    def _drain_inbox(self) -> None:
        raise NotImplementedError  # the Engine's: arrivals become requests, aborts take effect

    def _wake_up(self) -> None:
        raise NotImplementedError  # the Engine's: the loop looks at its inbox again

    def _hand_over(self, error: str) -> None:
        """Give every live request to another worker, continuing after its last streamed token."""
        self._drain_inbox()  # arrivals not yet seen become requests too; aborts take effect
        self._publish()
        target = self.successor(cast("Engine", self)) if self.successor is not None else None
        # An idle worker that goes away (scaled down, restarted, `up` stopping) costs nothing: info.
        report = self.log.error if self.streams else self.log.info
        if target is None:
            report("worker lost", error=error, continued=0, aborted=len(self.streams))
            self._abort_all(f"worker {self.worker} disconnected ({error}) and no other worker is attached")
            return
        orphans = [
            self._orphan(req, self.streams[req.rid])
            for req in self.scheduler.live_requests()
            if req.rid in self.streams
        ]
        for orphan in orphans:
            self.streams.pop(orphan.stream.rid)
            self._groups.pop(orphan.stream.call, None)
        report("worker lost", error=error, continued=len(orphans), on=target.worker)
        target.adopt(orphans)

    @staticmethod
    def _orphan(req: Request, stream: RequestStream) -> Orphan:
        """The request as a new arrival that continues right after the last token its client got."""
        streamed = req.output_ids[: stream.completion_tokens]
        params = dataclasses.replace(
            req.params, min_new_tokens=max(0, req.params.min_new_tokens - len(streamed))
        )
        if params.max_new_tokens is not None:
            params = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(streamed))
        return Orphan(stream, req.origin_input_ids + streamed, params)

    def _recover(self, exc: Exception) -> None:
        """Log the fault, replace the scheduler, and continue every live request on the fresh one.

        The old scheduler's state may be inconsistent, so nothing of it is kept but each request's
        prompt and streamed tokens; the worker is told to forget everything with the next plan. A
        request that lives through MAX_FAULTS_PER_REQUEST faults ends with an abort instead, so a
        request that triggers a bug cannot loop.
        """
        self.log.error("step loop fault: restarting this worker's scheduler", exc_info=exc)
        self._faults_in_a_row += 1
        if self._faults_in_a_row >= MAX_CONSECUTIVE_FAULTS:
            raise WorkerGone(
                f"the step loop failed {self._faults_in_a_row} times in a row ({exc!r})"
            ) from exc
        old = self.scheduler
        orphans = self._salvage()
        with contextlib.suppress(Exception):
            close_recording(old)
        self.scheduler = make_scheduler(self.config, self.limits)
        self._reset_worker, self._pool_dirty = True, True
        self._inbox.extend(orphans)

    def _salvage(self) -> list[Orphan]:
        with contextlib.suppress(Exception):
            self._publish()
        try:
            live = {req.rid: req for req in self.scheduler.live_requests()}
        except Exception:
            live = {}
        waiting = {s.rid for item in self._inbox if isinstance(item, Arrival) for s in item.streams}
        waiting |= {item.stream.rid for item in self._inbox if isinstance(item, Orphan)}
        orphans = []
        for stream in list(self.streams.values()):
            if stream.rid in waiting or stream.done:
                continue
            stream.faults += 1
            req = live.get(stream.rid)
            if req is None or stream.faults >= MAX_FAULTS_PER_REQUEST:
                self._finish_stream(stream, FinishReason.abort(INTERNAL_ERROR))
            else:
                orphans.append(self._orphan(req, stream))
        return orphans

    def adopt(self, orphans: list[Orphan]) -> None:
        """Take over requests of a lost worker: their streams continue here."""
        for orphan in orphans:
            stream = orphan.stream
            self.streams[stream.rid] = stream
            self._groups.setdefault(stream.call, []).append(stream.rid)
            self._inbox.append(orphan)
        self._wake_up()

    def _admit_orphan(self, orphan: Orphan) -> None:
        try:
            self.scheduler.add_request(orphan.stream.rid, orphan.input_ids, orphan.params)
        except (QueueFull, RequestRejected, ValueError) as exc:
            message = f"its worker was lost and {self.worker} could not take it over: {exc}"
            self._finish_stream(orphan.stream, FinishReason.abort(message))
