"""Faults, contained where they arise: a lost worker's requests continue on another engine from
their last streamed token, and a fault of our own restarts this worker's scheduler with every live
request continued on the fresh one (a loop that serves everyone never dies of one exception).

Either way a request continues as an Orphan: its prompt plus the tokens its client already has,
with what is left of its token budget. Results of plans still in flight are lost with the worker
or the old scheduler; their tokens were never published, so nothing is repeated or skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Protocol

import structlog

from control_plane.core.inbox import LiveSample, Orphan
from control_plane.core.publisher import INTERNAL_ERROR, Streams
from control_plane.request import FinishReason, Request, RequestParams
from control_plane.scheduler.scheduler import Scheduler

# A request live during this many faults of our own is ended rather than tried again.
MAX_FAULTS_PER_REQUEST = 2
# This many faults in a row, with no step completed between them, and the worker is given up.
MAX_CONSECUTIVE_FAULTS = 3


class WorkerGone(Exception):
    """The worker's stream ended or broke."""


class Heir(Protocol):
    """An engine that can take over requests (the router picks it)."""

    @property
    def worker(self) -> str: ...

    def adopt(self, orphans: list[Orphan]) -> None: ...


def orphan_of(req: Request, sample: LiveSample) -> Orphan:
    """The request as a new arrival that continues right after its last published token."""
    input_ids, params = continuation(req)
    return Orphan(sample, input_ids, params)


def continuation(req: Request) -> tuple[list[int], RequestParams]:
    """The prompt and parameters of a new arrival that continues `req` right after its last
    published token (the live engine's orphans and the simulator's hand-overs alike)."""
    streamed = list(req.output_ids)
    params = dataclasses.replace(req.params, min_new_tokens=max(0, req.params.min_new_tokens - len(streamed)))
    if params.max_new_tokens is not None:
        params = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(streamed))
    params = dataclasses.replace(params, generated_before=params.generated_before + len(streamed))
    if req.scores_sent or streamed:
        # The client has its prompt scores: the continuation scores nothing again. Unsent ones are
        # computed again from the start on the heir (the rows received here were never published).
        params = dataclasses.replace(params, logprob_start_len=-1)
    return req.origin_input_ids + streamed, params


class HandOver:
    """Where one engine's requests go when it cannot go on with them."""

    def __init__(
        self,
        streams: Streams,
        worker: str,
        log: structlog.typing.FilteringBoundLogger,
        find_heir: Callable[[], Heir | None],
    ) -> None:
        self._streams = streams
        self._worker = worker
        self._log = log
        self._find_heir = find_heir
        self._faults_in_a_row = 0

    def heir(self) -> Heir | None:
        """The engine that would take over now (None: no other one can)."""
        return self._find_heir()

    def worker_lost(self, scheduler: Scheduler, error: str) -> None:
        """Give every live request to another engine, continuing after its last streamed token; with
        none to take them, every live sample ends with an abort that says why."""
        self._streams.publish(scheduler.take_updates())
        heir = self.heir()
        # An idle worker that goes away (scaled down, restarted, `up` stopping) costs nothing: info.
        report = self._log.error if self._streams else self._log.info
        if heir is None:
            report("worker lost", error=error, continued=0, aborted=len(self._streams))
            self._streams.abort_all(
                f"worker {self._worker} disconnected ({error}) and no other worker is attached"
            )
            return
        continued = self.give_away(scheduler.live_requests(), heir)
        report("worker lost", error=error, continued=len(continued), on=heir.worker)
        # Samples the scheduler did not hold (none, unless something is off) end here.
        self._streams.abort_all(f"worker {self._worker} disconnected ({error})")

    def give_away(self, reqs: list[Request], heir: Heir) -> list[str]:
        """Continue these requests on `heir` from their last published token (publish first); their
        samples leave this engine. Returns their ids (the scheduler here still holds them)."""
        orphans = []
        for req in reqs:
            sample = self._streams.get(req.rid)
            if sample is not None:
                orphans.append(orphan_of(req, sample))
                self._streams.leave(sample)
        heir.adopt(orphans)
        return [orphan.sample.rid for orphan in orphans]

    def step_completed(self) -> None:
        """A step went through: the faults before it were not in a row."""
        self._faults_in_a_row = 0

    def salvage(self, scheduler: Scheduler, exc: Exception, waiting: set[str]) -> list[Orphan]:
        """A fault of our own: what of the live samples continues on a fresh scheduler.

        The old scheduler's state may be inconsistent, so nothing of it is kept but each request's
        prompt and published tokens. A sample that lives through MAX_FAULTS_PER_REQUEST faults ends
        with an abort instead, so a request that triggers a bug cannot loop; MAX_CONSECUTIVE_FAULTS
        with no step between them give the worker up (WorkerGone). `waiting`: samples whose items
        are still in the inbox (the fresh scheduler sees them there).
        """
        self._faults_in_a_row += 1
        if self._faults_in_a_row >= MAX_CONSECUTIVE_FAULTS:
            raise WorkerGone(
                f"the step loop failed {self._faults_in_a_row} times in a row ({exc!r})"
            ) from exc
        with contextlib.suppress(Exception):
            self._streams.publish(scheduler.take_updates())
        try:
            live = {req.rid: req for req in scheduler.live_requests()}
        except Exception:
            live = {}
        orphans = []
        for rid in self._streams.rids():
            sample = self._streams.get(rid)
            if sample is None or rid in waiting:
                continue
            sample.faults += 1
            req = live.get(rid)
            if req is None or sample.faults >= MAX_FAULTS_PER_REQUEST:
                self._streams.finish(sample, FinishReason.abort(INTERNAL_ERROR))
            else:
                orphans.append(orphan_of(req, sample))
        return orphans
