"""SGLang's request timeouts (docs/scheduler.md#step-loop step 2, docs/scheduler.md#intake):
`--waiting-timeout` and `--running-timeout` (SGLANG_REQ_WAITING_TIMEOUT / _RUNNING_TIMEOUT; <= 0 is off).

The scheduler has no wall clock, so the engine decides on its own clock and acts through
scheduler calls that the recorder writes down (replay stays exact):

- the waiting timeout counts from a request's latest (re-)entry into the waiting queue (SGLang
  overwrites `wait_queue_entry_time` on every re-queue, retraction and preemption included) and
  applies to every waiting request; it aborts with "Request waiting timeout reached." (503);
- the running timeout applies to the running batch, counted from the request's first forward
  (SGLang's forward_entry_time): an abort with "Request running timeout reached." (503) that, as every
  abort of a running request, ends it at its next decode with its KV cached (SGLang sets to_finish,
  docs/scheduler.md#aborts).
"""

from __future__ import annotations

from collections.abc import Callable

from control_plane.request import FinishReason
from control_plane.scheduler.scheduler import Scheduler

WAITING_TIMEOUT = "Request waiting timeout reached."
RUNNING_TIMEOUT = "Request running timeout reached."


class Timeouts:
    """Per engine. `check(scheduler, now)` once per loop turn; it costs O(waiting + running)."""

    def __init__(
        self, waiting_s: float, running_s: float, first_forward: Callable[[str], float | None]
    ) -> None:
        self.waiting_s = waiting_s
        self.running_s = running_s
        # When the request first had a forward (the engine's record of its admission).
        self._first_forward = first_forward
        # rid -> (the scheduler's entry stamp, wall time we first saw the request waiting with it).
        self._entered: dict[str, tuple[int, float]] = {}

    @property
    def enabled(self) -> bool:
        return self.waiting_s > 0 or self.running_s > 0

    def poll_s(self) -> float | None:
        """How long an idle loop may sleep before it must look again."""
        limits = [t for t in (self.waiting_s, self.running_s) if t > 0]
        return min(limits) / 4 if limits else None

    def note_waiting(self, sched: Scheduler, now: float) -> None:
        """Stamp requests that (re-)entered the waiting queue since the last look with `now`. Called
        right after every scheduler call that can re-queue (arrivals, the plan's retractions and
        preemptions), before the step's I/O, so a re-queue is timed from when it happened."""
        if self.waiting_s <= 0:
            return
        entered: dict[str, tuple[int, float]] = {}
        for req in sched.waiting:
            seen = self._entered.get(req.rid)
            if seen is None or seen[0] != req.wait_queue_entry_time:
                seen = (req.wait_queue_entry_time, now)
            entered[req.rid] = seen
        self._entered = entered

    def check(self, sched: Scheduler, now: float) -> None:
        """Apply both timeouts as of `now`."""
        self.note_waiting(sched, now)
        if self.waiting_s > 0:
            for rid, (_, since) in list(self._entered.items()):
                if now - since > self.waiting_s:
                    sched.abort(rid, FinishReason.abort(WAITING_TIMEOUT))
                    del self._entered[rid]
        if self.running_s > 0:
            self._check_running(sched, now)

    def _check_running(self, sched: Scheduler, now: float) -> None:
        for req in list(sched.running.reqs):
            started = self._first_forward(req.rid)
            if not req.finished and started is not None and now - started > self.running_s:
                sched.abort(req.rid, FinishReason.abort(RUNNING_TIMEOUT))
