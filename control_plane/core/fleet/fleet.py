"""One control plane's workers as each worker's engine sees the others: the object an engine is
given instead of reaching for other engines itself.

It reads the plain values placement decides from off the live members (their rooms, loads and
roles), asks placement.py, and hands the plan back to the engine that asked, which starts the
moves. What spans workers is kept here: the back-off of destinations whose moves failed
(backoff.py), on the clock the fleet is given, and the test knob's seeded generators. When a worker leaves
or its loop ends, every copy on its way to it from another worker fails at once (`leaving`,
`gone`): the calls go on at their sources (or recompute on an heir, when they had switched)
instead of waiting on a destination that will not report.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Generic, TypeVar

import structlog

from control_plane.core.fleet import placement
from control_plane.core.fleet.backoff import Backoff
from control_plane.core.fleet.member import Member
from control_plane.core.fleet.placement import NO_ROOM, NO_SPILL, Peer, Plan, Rules, unreachable
from control_plane.core.fleet.router import Router

log = structlog.get_logger("stepwise.fleet")

M = TypeVar("M", bound=Member)


class Fleet(Generic[M]):
    def __init__(
        self,
        router: Router[M] | None = None,
        on_leaving: Callable[[M], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # A fleet of one (no router given): no heir, no peers.
        self.router: Router[M] = router if router is not None else Router("")
        self._on_leaving = on_leaving
        # Seconds on any monotonic clock (a simulator passes its own).
        self._clock = clock
        self.backoff = Backoff()
        self._rngs: dict[str, random.Random] = {}

    def heir(self, member: M) -> M | None:
        """Who continues a lost or leaving worker's requests (the router's successor)."""
        return self.router.successor(member)

    def member(self, worker: str) -> M | None:
        """The attached engine of `worker`."""
        return self.router.engines.get(worker)

    def leaving(self, member: M) -> None:
        """`member` started to drain or move away."""
        if self._on_leaving is not None:
            self._on_leaving(member)
        self._release(member, f"worker {member.worker} is leaving")

    def gone(self, member: M) -> None:
        """`member`'s loop ended (lost, dropped, drained or stopped)."""
        self._release(member, f"worker {member.worker} is gone")
        self.backoff.forget(member.worker)  # one that attaches under its id starts afresh

    def started(self, worker: str) -> None:
        """A move toward `worker` started."""
        self.backoff.started(worker)

    def moved(self, worker: str, landed: bool) -> None:
        """A move toward `worker` had its outcome."""
        if landed:
            self.backoff.landed(worker)
            return
        seconds = self.backoff.failed(worker, self._clock())
        log.info("a move failed: the destination sits out", worker=worker, seconds=round(seconds, 3))

    def _release(self, member: M, why: str) -> None:
        for engine in list(self.router.engines.values()):
            if engine is not member:
                engine.destination_gone(member.worker, why)

    # --- placement ------------------------------------------------------------------------------

    def place(self, member: M, rules: Rules) -> Plan:
        """After a step of `member`'s worker: what moves (and where its retractions spill)."""
        steps = rules.steps
        if rules.test_interval and member.steps % rules.test_interval == 0:
            rng = self._rngs.setdefault(member.worker, random.Random(member.worker))
            return placement.one_at_random(member.calls(steps, False), self._peers(member, steps), rng)
        if member.limits.role == "prefill":
            ready = [c for c in member.calls(steps, False) if c.ready]
            if not ready:
                return Plan()
            return placement.to_decode(ready, self._peers(member, steps, "decode", True), steps)
        if not rules.kv_balance:
            return Plan()
        here = member.room(steps)
        if not member.serving or (here.headroom >= 0 and not here.queued):
            return Plan(spill=NO_SPILL)  # the common case: two reads
        peers = self._peers(member, steps, member.limits.role, True)
        return placement.balance(here, peers, member.calls(steps, True), rules, member.balancing())

    def drain(self, member: M) -> Plan:
        """A turn of `member` leaving: where each of its calls goes."""
        return placement.drain(member.calls(0, False), self._peers(member, 0))

    def _peers(self, member: M, steps: int, role: str | None = None, rooms: bool = False) -> list[Peer]:
        """The workers `member` can move calls to now (of `role`, when given): serving and
        reachable, and not sitting out a back-off, with their rooms when asked; a worker's load
        counts the samples on their way to it (a hung destination's copies never land: without them
        it would stay the least loaded)."""
        now = self._clock()
        heading: Counter[str] = Counter()
        for engine in self.router.engines.values():
            heading.update(engine.heading())
        peers = []
        for other in self.router.available():
            if other is member or (role is not None and other.limits.role != role):
                continue
            if unreachable(member.limits, other.limits) or not self.backoff.allows(other.worker, now):
                continue
            room = other.room(steps) if rooms else NO_ROOM
            load = sum(other.load()) + heading[other.worker]
            once = self.backoff.on_probation(other.worker)
            peers.append(Peer(other.worker, other.limits.role, room, load, once))
        return peers
