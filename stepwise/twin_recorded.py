"""The fleet twin on a live fleet's recording: each worker's steps timed as live measured them, and each
request arriving between the plans it arrived between live (docs/debugging.md#twin).

A live fleet recorded with `--record DIR` leaves one session per worker. Given those sessions, the
twin (stepwise/twin.py: a real Scheduler per worker behind the fleet's Router and placement) runs
with worker i the i-th session in worker-id order, so the Router's order of workers is live's; each
step of worker i moves its clock by the forward_s the live worker measured for that step; and a
request is handed to its worker's scheduler when that scheduler has made as many plans as the live
one had when the request was added (the session's AddRequest stamp), in the session's order.

Where a request goes is still the twin's decision unless `pinned`: with routing keys (a function
of the key and the workers' ids) the twin's Router must pick what live picked, and a request whose
recorded worker it did not pick is never handed over (the run ends stuck). Load- and cache-aware
routing read the workers' state at the instant a request arrives, which a recording does not hold
for the workers that did not take it; `pinned` routes each request where the recording found it,
so the schedulers can still be compared. Moves between workers (migration, balancing, hand-over)
are the twin's own: a recording in which a request was added on two workers is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from control_plane.record.entries import AddRequest, ApplyResult, Header, NextPlan, OnIdle
from control_plane.record.files import RecordingError, read_entries
from control_plane.record.recorder import RecordingScheduler, Sink
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import StepResult, WorkerLimits
from stepwise import costs
from stepwise.simulate import RecordingTooShort, SimulationStuck, TraceRequest
from stepwise.twin import SimWorker, Twin, TwinSetup


@dataclass(frozen=True, slots=True)
class WorkerRecording:
    """What the twin takes from one live worker's session."""

    header: Header
    # rid -> the plans made when it was added, in the order the requests were added.
    arrivals: Mapping[str, int]
    # step id -> the forward seconds the worker measured.
    seconds: Mapping[int, float]
    # The requests added after the scheduler went idle at their step (an OnIdle of that step first).
    after_idle: frozenset[str] = frozenset()
    # The planned steps after the last measured one: a stop cut them off (stepwise.costs.RecordedSteps).
    cut_off: frozenset[int] = frozenset()


def read_worker(session: Path) -> WorkerRecording:
    """One worker's session (a session name, a part file, or a directory holding one session);
    RecordingError when it cannot be read or a request was added twice."""
    entries = iter(read_entries(session))
    header = next(entries, None)
    if not isinstance(header, Header):
        raise RecordingError(f"{session}: does not start with a recording header")
    arrivals: dict[str, int] = {}
    seconds: dict[int, float] = {}
    after_idle: set[str] = set()
    idle_at = -1
    last_planned: int | None = None
    for entry in entries:
        if isinstance(entry, AddRequest):
            if entry.rid in arrivals:
                raise RecordingError(f"{session}: request {entry.rid!r} was added twice (moved back)")
            arrivals[entry.rid] = entry.step
            if entry.step == idle_at:
                after_idle.add(entry.rid)
        elif isinstance(entry, OnIdle):
            idle_at = entry.step
        elif isinstance(entry, ApplyResult):
            seconds[entry.result.step_id] = entry.result.forward_s
        elif isinstance(entry, NextPlan) and entry.plan is not None:
            last_planned = entry.plan.step_id
    cut_off = costs.unmeasured(last_planned, seconds)
    return WorkerRecording(header, arrivals, seconds, frozenset(after_idle), cut_off)


def read_fleet(directory: Path) -> list[WorkerRecording]:
    """Every worker's session under a `--record DIR`, in worker-id order; RecordingError when a worker
    left more than one session (it reconnected: the twin has no reconnection) or none was found."""
    sessions = sorted({p.name.rsplit(".", 2)[0] for p in directory.glob("*.rec")})
    workers = [read_worker(directory / name) for name in sessions]
    if not workers:
        raise RecordingError(f"{directory}: no recording")
    ids = [w.header.limits.worker_id for w in workers]
    if len(set(ids)) != len(ids):
        raise RecordingError(f"{directory}: a worker left several sessions ({', '.join(sorted(ids))})")
    return sorted(workers, key=lambda w: w.header.limits.worker_id)


class RecordedTwin(Twin):
    """The twin with a live fleet's step seconds and arrival stamps, one recording per initial worker
    (see the module docstring). `sinks[i]`, when given, records worker i's scheduler calls."""

    def __init__(
        self,
        setup: TwinSetup,
        trace: Sequence[TraceRequest],
        recordings: Sequence[WorkerRecording],
        sinks: Sequence[Sink] = (),
        pinned: bool = False,
    ) -> None:
        if len(recordings) != len(setup.roles) or setup.events:
            raise ValueError("a recorded twin runs the recorded workers, one each, and no fleet events")
        self.recordings = list(recordings)
        self.sinks = list(sinks)
        self.pinned = pinned
        self.recorded_on = {rid: i for i, rec in enumerate(recordings) for rid in rec.arrivals}
        # Each worker's requests in the order live added them, and how many it has been handed.
        self.order = [list(rec.arrivals) for rec in recordings]
        self.handed = [0] * len(recordings)
        # Requests routed to a worker and not yet handed to it, by rid.
        self.held: list[dict[str, TraceRequest]] = [{} for _ in recordings]
        # The step at which each worker's scheduler last went idle.
        self.idled = [-1] * len(recordings)
        # (worker, step) of each step a stop cut off that came, each taking 0 s.
        self.unmeasured: list[tuple[int, int]] = []
        # Every request is routed at once, in trace order: when it reaches its scheduler is the stamp's
        # business, not the clock's (so aborts by time have no place here either).
        super().__init__(setup, [dataclasses.replace(r, arrival=0.0, abort_at=None) for r in trace])

    def _new_scheduler(self, index: int, limits: WorkerLimits) -> Scheduler:
        if index < len(self.sinks):
            return RecordingScheduler(self.setup.base.config, limits, self.sinks[index])
        return super()._new_scheduler(index, limits)

    def _step_seconds(self, worker: SimWorker, result: StepResult) -> float:
        recording = self.recordings[worker.index]
        seconds = recording.seconds.get(result.step_id)
        if seconds is not None:
            return seconds
        if result.step_id in recording.cut_off and self._all_finished(worker):
            # The step a stop cut off (stepwise/simulate.py, Simulation._seconds): 0 s.
            self.unmeasured.append((worker.index, result.step_id))
            return 0.0
        raise RecordingTooShort(f"worker {worker.index}: step {result.step_id} was not measured live")

    def _all_finished(self, worker: SimWorker) -> bool:
        """Every request live added on `worker` has been handed to it and has finished. Not the whole
        trace's: each worker's clock here skips the idle waits live had, so another worker may still
        be running what live had finished before the stop."""
        order = self.order[worker.index]
        return self.handed[worker.index] == len(order) and all(
            self.progress[rid].finished is not None for rid in order
        )

    def _route(self, req: TraceRequest) -> SimWorker | None:
        if self.pinned and req.rid in self.recorded_on:
            return self.workers[self.recorded_on[req.rid]]
        return super()._route(req)

    def _arrive(self, req: TraceRequest) -> None:
        super()._arrive(req)
        owner = self.progress[req.rid].owner
        if owner is not None:  # held until its scheduler has made the plans it had made live
            owner.arrivals.remove(req)
            self.held[owner.index][req.rid] = req

    def _due(self, worker: SimWorker) -> str | None:
        """The next request live added on `worker`, if it is due now: routed here, its stamp reached,
        and, when it came after the scheduler went idle, the scheduler idle at that step here too."""
        i = worker.index
        if self.handed[i] == len(self.order[i]):
            return None
        rid = self.order[i][self.handed[i]]
        step, now = self.recordings[i].arrivals[rid], worker.scheduler.step_id
        if rid not in self.held[i] or step > now:
            return None
        if step == now and rid in self.recordings[i].after_idle and self.idled[i] != now:
            return None
        return rid

    def _drain_inbox(self, worker: SimWorker) -> None:
        while (rid := self._due(worker)) is not None:
            # Its latencies count from when it reached the scheduler on this clock.
            self.progress[rid].arrival = worker.clock
            worker.arrivals.append(self.held[worker.index].pop(rid))
            self.handed[worker.index] += 1
        super()._drain_inbox(worker)

    def _turn(self, worker: SimWorker) -> None:
        super()._turn(worker)
        if worker.alive and not worker.scheduled and worker.scheduler.is_idle:
            # Asleep, idle: what live added after going idle here is due now.
            self.idled[worker.index] = worker.scheduler.step_id
            if self._due(worker) is not None:
                self._wake(worker, worker.clock)

    def run(self) -> dict[str, object]:
        summary = super().run()
        routed = {rid: i for i, held in enumerate(self.held) for rid in held}
        if routed:
            where = ", ".join(
                f"{rid} on {i} (live: {self.recorded_on.get(rid)})" for rid, i in routed.items()
            )
            raise SimulationStuck(f"not as recorded: requests never handed to their worker: {where}")
        return summary
