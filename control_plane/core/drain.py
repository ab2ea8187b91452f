"""A worker leaving its control plane: it asked to (Drain: it got SIGTERM), or
the control plane asked it to (Move: to even out control planes, or because this one drains).

The procedure is the same either way. From the moment it starts, the router gives the worker
nothing new. Its queued requests that have not started (waiting, with no KV of their own) move to
another worker at once, if there is one, by the lost-worker hand-over (handover.py). Its running
requests finish here, so nothing computed is computed again. Once nothing is live on it, the
session ends: with Shutdown after a drain, with Move after a move. If `--drain-timeout` passes
first, the requests still live continue on another worker from their last streamed token (again
the lost-worker hand-over), and the session ends the same way.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Protocol

import structlog

from control_plane.core.handover import HandOver
from control_plane.core.publisher import Streams
from control_plane.request import FinishReason, Request
from control_plane.scheduler.scheduler import Scheduler

DRAINED = "drained"
# Why a request left the scheduler of a leaving worker (never published: its stream goes on).
HANDED_OVER = FinishReason.abort("continued on another worker")


class Departure(enum.Enum):
    """How the session ends once the worker has nothing live."""

    SHUTDOWN = "shutdown"  # the worker drains: it stops
    MOVE = "move"  # the worker attaches to another control plane


@dataclass(slots=True)
class Leaving:
    """A drain or move under way, and what the two log lines say about it."""

    departure: Departure
    reason: str
    started: float
    deadline: float
    # The queued requests were moved (done on the engine's loop, at the first turn after the start).
    begun: bool = False
    running: int = 0
    queued: int = 0
    moved: int = 0
    # Live on the worker once the queued ones moved, and handed over when the timeout passed.
    staying: int = 0
    handed_over: int = 0
    # Running samples migrated to another worker with their KV (docs/migration.md).
    migrated: int = 0


class _Channel(Protocol):
    async def close(self, reason: str) -> None: ...

    async def move(self, reason: str) -> None: ...


class Drain:
    """One engine's way out: drain (the worker asked) or move (we asked). The engine calls it on
    its own loop: `begin` at the first turn after `start`, `check_deadline` every turn after, and
    `depart` once nothing is live and no plan is in flight."""

    def __init__(
        self,
        drain_timeout_s: float,
        streams: Streams,
        handover: HandOver,
        worker: str,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self._drain_timeout_s = drain_timeout_s
        self._streams = streams
        self._handover = handover
        self._worker = worker
        self._log = log
        self.leaving: Leaving | None = None

    def start(self, departure: Departure, reason: str) -> bool:
        """Start leaving; True when this call started it. A second call changes nothing, except
        that a worker's own drain wins over our move: it is stopping, so it is told Shutdown."""
        if self.leaving is not None:
            if departure is Departure.SHUTDOWN:
                self.leaving.departure = departure
            return False
        now = time.monotonic()
        self.leaving = Leaving(departure, reason, now, now + self._drain_timeout_s)
        return True

    def wait_s(self) -> float | None:
        """How long an idle loop may sleep before the drain timeout needs a look."""
        if self.leaving is None or not self._streams:
            return None
        return max(self.leaving.deadline - time.monotonic(), 0.0)

    def begin(self, scheduler: Scheduler, load: tuple[int, int]) -> None:
        """Move the queued requests that have not started to another worker, if there is one.
        `load`: the engine's (queued, running) as it starts, for the log line."""
        leaving = self.leaving
        assert leaving is not None
        leaving.begun = True
        leaving.queued, leaving.running = load
        heir = self._handover.heir()
        if heir is not None:
            moved = self._handover.give_away(self._not_started(scheduler), heir)
            _withdraw(scheduler, moved)
            leaving.moved = len(moved)
        leaving.staying = len(self._streams)
        self._log.info(
            "worker moving" if leaving.departure is Departure.MOVE else "worker draining",
            reason=leaving.reason,
            running=leaving.running,
            queued=leaving.queued,
            moved=leaving.moved,
            to=heir.worker if heir is not None and leaving.moved else None,
            drain_timeout_s=self._drain_timeout_s,
        )

    def check_deadline(self, scheduler: Scheduler) -> None:
        """Past the drain timeout, what is still live continues elsewhere, or ends if nowhere."""
        leaving = self.leaving
        assert leaving is not None
        if self._streams and time.monotonic() >= leaving.deadline:
            self._hand_over_live(scheduler, leaving)

    def _not_started(self, scheduler: Scheduler) -> list[Request]:
        """Waiting requests that hold nothing on the worker, by whole calls (the samples of a call
        stay together)."""
        fresh = {
            req.rid: req
            for req in scheduler.waiting
            if req.num_outputs == 0 and req.host_backup_len == 0 and req.handle < 0
        }
        out: list[Request] = []
        for live in self._streams.live_calls():
            if all(rid in fresh for rid in live):
                out.extend(fresh[rid] for rid in live)
        return out

    def _hand_over_live(self, scheduler: Scheduler, leaving: Leaving) -> None:
        self._streams.publish(scheduler.take_updates())  # tokens applied so far reach their clients first
        live = [req for req in scheduler.live_requests() if req.rid in self._streams]
        heir = self._handover.heir()
        if heir is not None:
            moved = self._handover.give_away(live, heir)
            _withdraw(scheduler, moved)
            leaving.handed_over = len(moved)
        else:
            reason = FinishReason.abort(
                f"worker {self._worker} drained: --drain-timeout {self._drain_timeout_s:g} s passed "
                "and no other worker is attached"
            )
            for req in live:
                scheduler.abort(req.rid, reason)
            self._streams.publish(scheduler.take_updates())
        # Samples the scheduler no longer knows (none, unless something is off) end here too.
        self._streams.abort_all(f"worker {self._worker} drained")
        self._log.warning(
            "drain timeout passed", handed_over=leaving.handed_over, on=heir.worker if heir else None
        )

    async def depart(self, channel: _Channel) -> None:
        """End the session: Shutdown after a drain, Move after a move."""
        leaving = self.leaving
        assert leaving is not None
        seconds = round(time.monotonic() - leaving.started, 3)
        self._log.info(
            "worker moved" if leaving.departure is Departure.MOVE else "worker drained",
            finished=leaving.staying - leaving.handed_over - leaving.migrated,
            handed_over=leaving.handed_over,
            migrated=leaving.migrated,
            seconds=seconds,
        )
        if leaving.departure is Departure.MOVE:
            await channel.move(leaving.reason)
        else:
            await channel.close(DRAINED)


def _withdraw(scheduler: Scheduler, rids: list[str]) -> None:
    """Take requests that now continue on another worker out of this scheduler. Their samples
    are gone from here, so the finish is never published, and tokens of plans still in flight
    for them are discarded (their rows are freed)."""
    for rid in rids:
        scheduler.abort(rid, HANDED_OVER)
