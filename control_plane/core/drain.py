"""A worker leaving its control plane (part of the Engine): it asked to (Drain: it got SIGTERM), or
the control plane asked it to (Move: to even out control planes, or because this one drains).

The procedure is the same either way. From the moment it starts, the router gives the worker
nothing new. Its queued requests that have not started (waiting, with no KV of their own) move to
another worker at once, if there is one, by the lost-worker hand-over (failover.py). Its running
requests finish here, so nothing computed is computed again. Once nothing is live on it, the
session ends: with Shutdown after a drain, with Move after a move. If `--drain-timeout` passes
first, the requests still live continue on another worker from their last streamed token (again
the lost-worker hand-over), and the session ends the same way.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from control_plane.core.failover import Failover
from control_plane.request import FinishReason, Request

if TYPE_CHECKING:
    from control_plane.core.engine import Engine

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


class _Channel(Protocol):
    async def close(self, reason: str) -> None: ...

    async def move(self, reason: str) -> None: ...


class Draining(Failover):
    """Leaving the control plane: drain (the worker asked) or move (we asked)."""

    channel: Any
    _inflight: deque[Any]
    # Called when the engine starts leaving (the router's counts and health change).
    on_leaving: Callable[[Engine], None] | None
    leaving: Leaving | None
    departed: bool

    def load(self) -> tuple[int, int]:
        raise NotImplementedError  # the Engine's: (queued, running)

    def leave(self, departure: Departure, reason: str) -> None:
        """Start leaving (at once for the router, on the loop's next turn for the requests). A
        second call changes nothing, except that a worker's own drain wins over our move: it is
        stopping, so it is told Shutdown."""
        if self.leaving is not None:
            if departure is Departure.SHUTDOWN:
                self.leaving.departure = departure
            return
        now = time.monotonic()
        self.leaving = Leaving(departure, reason, now, now + self.config.drain_timeout_s)
        if self.on_leaving is not None:
            self.on_leaving(cast("Engine", self))
        self._wake_up()

    def worker_draining(self, reason: str) -> None:
        """The worker sent Drain (its channel calls this)."""
        self.leave(Departure.SHUTDOWN, reason or "the worker is stopping")

    def _leave_turn(self) -> bool:
        """One loop turn of leaving: True once nothing is live and no plan is in flight."""
        leaving = self.leaving
        assert leaving is not None
        if not leaving.begun:
            self._begin_leaving(leaving)
        if self.samples and time.monotonic() >= leaving.deadline:
            self._hand_over_live(leaving)
        return not self.samples and not self._inflight

    def _leave_wait_s(self) -> float | None:
        """How long an idle loop may sleep before the drain timeout needs a look."""
        if self.leaving is None or not self.samples:
            return None
        return max(self.leaving.deadline - time.monotonic(), 0.0)

    def _begin_leaving(self, leaving: Leaving) -> None:
        leaving.begun = True
        leaving.queued, leaving.running = self.load()
        target = self._successor()
        if target is not None:
            moved = self._give_away(self._not_started(), target)
            self._withdraw(moved)
            leaving.moved = len(moved)
        leaving.staying = len(self.samples)
        self.log.info(
            "worker moving" if leaving.departure is Departure.MOVE else "worker draining",
            reason=leaving.reason,
            running=leaving.running,
            queued=leaving.queued,
            moved=leaving.moved,
            to=target.worker if target is not None and leaving.moved else None,
            drain_timeout_s=self.config.drain_timeout_s,
        )

    def _not_started(self) -> list[Request]:
        """Waiting requests that hold nothing on the worker, by whole calls (the samples of a call
        stay together)."""
        fresh = {
            req.rid: req
            for req in self.scheduler.waiting
            if req.num_outputs == 0 and req.host_backup_len == 0 and req.handle < 0
        }
        out: list[Request] = []
        for rids in self._groups.values():
            live = [rid for rid in rids if rid in self.samples]
            if live and all(rid in fresh for rid in live):
                out.extend(fresh[rid] for rid in live)
        return out

    def _hand_over_live(self, leaving: Leaving) -> None:
        """The drain timeout passed: what is still live continues elsewhere, or ends if nowhere."""
        self._publish()  # tokens applied so far reach their clients first
        live = [req for req in self.scheduler.live_requests() if req.rid in self.samples]
        target = self._successor()
        if target is not None:
            moved = self._give_away(live, target)
            self._withdraw(moved)
            leaving.handed_over = len(moved)
        else:
            reason = FinishReason.abort(
                f"worker {self.worker} drained: --drain-timeout {self.config.drain_timeout_s:g} s passed "
                "and no other worker is attached"
            )
            for req in live:
                self.scheduler.abort(req.rid, reason)
            self._publish()
        # Samples the scheduler no longer knows (none, unless something is off) end here too.
        self._abort_all(f"worker {self.worker} drained")
        self.log.warning(
            "drain timeout passed", handed_over=leaving.handed_over, on=target.worker if target else None
        )

    def _withdraw(self, rids: list[str]) -> None:
        """Take requests that now continue on another worker out of this scheduler. Their samples
        are gone from here, so the finish is never published, and tokens of plans still in flight
        for them are discarded (their rows are freed)."""
        for rid in rids:
            self.scheduler.abort(rid, HANDED_OVER)

    def _successor(self) -> Engine | None:
        return self.successor(cast("Engine", self)) if self.successor is not None else None

    async def _depart(self) -> None:
        """End the session: Shutdown after a drain, Move after a move."""
        leaving = self.leaving
        assert leaving is not None
        self.departed = True
        seconds = round(time.monotonic() - leaving.started, 3)
        self.log.info(
            "worker moved" if leaving.departure is Departure.MOVE else "worker drained",
            finished=leaving.staying - leaving.handed_over,
            handed_over=leaving.handed_over,
            seconds=seconds,
        )
        channel = cast(_Channel, self.channel)
        if leaving.departure is Departure.MOVE:
            await channel.move(leaving.reason)
        else:
            await channel.close(DRAINED)
