"""Faults, contained where they arise: a lost worker's requests continue on another worker from
their last streamed token, and a fault of our own restarts this worker's scheduler (a loop that
serves everyone never dies of one exception)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from control_plane.config import ControlConfig
from control_plane.core.inbox import Arrival, Item, LiveSample, Orphan
from control_plane.core.publishing import INTERNAL_ERROR, Publishing
from control_plane.record.recorder import close_recording, make_scheduler
from control_plane.request import FinishReason, Request
from control_plane.scheduler.scheduler import QueueFull, RequestRejected
from protos.worker import WorkerLimits

if TYPE_CHECKING:
    from control_plane.core.engine import Engine

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
    _inbox: list[Item]
    successor: Callable[[Engine], Engine | None] | None
    _reset_worker: bool
    _faults_in_a_row: int
    _pool_dirty: bool

    def _drain_inbox(self) -> None:
        raise NotImplementedError  # the Engine's: arrivals become requests, aborts take effect

    def _wake_up(self) -> None:
        raise NotImplementedError  # the Engine's: the loop looks at its inbox again

    def _hand_over(self, error: str) -> None:
        """Give every live request to another worker, continuing after its last streamed token.

        Results of plans still in flight are lost with the worker; their tokens were never
        published, so each request continues from what its client has."""
        self._drain_inbox()  # arrivals not yet seen become requests too; aborts take effect
        self._publish()
        target = self.successor(cast("Engine", self)) if self.successor is not None else None
        # An idle worker that goes away (scaled down, restarted, `up` stopping) costs nothing: info.
        report = self.log.error if self.samples else self.log.info
        if target is None:
            report("worker lost", error=error, continued=0, aborted=len(self.samples))
            self._abort_all(f"worker {self.worker} disconnected ({error}) and no other worker is attached")
            return
        continued = self._give_away(self.scheduler.live_requests(), target)
        report("worker lost", error=error, continued=len(continued), on=target.worker)

    def _give_away(self, reqs: list[Request], target: Engine) -> list[str]:
        """Continue these requests on `target` from their last published token (publish first);
        their samples leave this engine. Returns their ids (the scheduler here still holds them)."""
        orphans = [self._orphan(req, self.samples[req.rid]) for req in reqs if req.rid in self.samples]
        for orphan in orphans:
            self.samples.pop(orphan.sample.rid)
            self._groups.pop(orphan.sample.call, None)
        target.adopt(orphans)
        return [orphan.sample.rid for orphan in orphans]

    @staticmethod
    def _orphan(req: Request, sample: LiveSample) -> Orphan:
        """The request as a new arrival that continues right after its last published token."""
        streamed = list(req.output_ids)
        params = dataclasses.replace(
            req.params, min_new_tokens=max(0, req.params.min_new_tokens - len(streamed))
        )
        if params.max_new_tokens is not None:
            params = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(streamed))
        return Orphan(sample, req.origin_input_ids + streamed, params)

    def _recover(self, exc: Exception) -> None:
        """Log the fault, replace the scheduler, and continue every live request on the fresh one.

        The old scheduler's state may be inconsistent, so nothing of it is kept but each request's
        prompt and published tokens; the worker is told to forget everything with the next plan. A
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
        self._forget_in_flight()
        self._reset_worker, self._pool_dirty = True, True
        self._inbox.extend(orphans)

    def _forget_in_flight(self) -> None:
        raise NotImplementedError  # the Engine's: results still due are read and dropped

    def _salvage(self) -> list[Orphan]:
        with contextlib.suppress(Exception):
            self._publish()
        try:
            live = {req.rid: req for req in self.scheduler.live_requests()}
        except Exception:
            live = {}
        waiting = {s.rid for item in self._inbox if isinstance(item, Arrival) for s in item.samples}
        waiting |= {item.sample.rid for item in self._inbox if isinstance(item, Orphan)}
        orphans = []
        for sample in list(self.samples.values()):
            if sample.rid in waiting:
                continue
            sample.faults += 1
            req = live.get(sample.rid)
            if req is None or sample.faults >= MAX_FAULTS_PER_REQUEST:
                self._finish_sample(sample, FinishReason.abort(INTERNAL_ERROR))
            else:
                orphans.append(self._orphan(req, sample))
        return orphans

    def adopt(self, orphans: list[Orphan]) -> None:
        """Take over requests of a lost worker: their streams continue here."""
        for orphan in orphans:
            sample = orphan.sample
            self.samples[sample.rid] = sample
            self._groups.setdefault(sample.call, []).append(sample.rid)
            self._inbox.append(orphan)
        self._wake_up()

    def _admit_orphan(self, orphan: Orphan) -> None:
        try:
            self.scheduler.add_request(
                orphan.sample.rid, orphan.input_ids, orphan.params, uid=orphan.sample.uid
            )
        except (QueueFull, RequestRejected, ValueError) as exc:
            message = f"its worker went away and {self.worker} could not take it over: {exc}"
            self._finish_sample(orphan.sample, FinishReason.abort(message))
