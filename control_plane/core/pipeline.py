"""The plans on their way to one worker: sent, and not yet answered.

With overlap (the default, docs/scheduler.md#overlap) two plans are in flight, so the worker starts
a step the moment the previous one ends; without it, one. Results come in the order the plans
went. Each plan keeps what its result will be checked against; one made by a scheduler since
replaced (after a fault of ours) is read and dropped. A worker with no result within the deadline
of the tokens in flight is hung.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from control_plane.core.worker_checks import WorkerFault
from control_plane.scheduler.records import StepStats
from protos.worker import StepPlan, StepResult


@dataclass(frozen=True, slots=True)
class InFlight:
    """A plan sent and not yet answered, with what its result will be checked against."""

    plan: StepPlan
    stats: StepStats
    # (live sequences, slots in their tables) the worker must report after this plan.
    books: tuple[int, int]
    # Planned by a scheduler since replaced (after a fault of ours): its result is read and dropped.
    stale: bool = False


class _Wire(Protocol):
    async def send(self, plan: StepPlan) -> None: ...

    async def receive(self) -> StepResult: ...


class Pipeline:
    """Up to `depth` plans in flight to one worker, oldest first."""

    def __init__(self, wire: _Wire, depth: int, deadline_s: Callable[[int], float]) -> None:
        self.depth = depth
        self._wire = wire
        # The step deadline for so many tokens in flight (--step-deadline).
        self._deadline_s = deadline_s
        self._flights: deque[InFlight] = deque()
        # The next plan tells the worker to forget everything (after a fault of ours).
        self._reset_worker = False

    def __bool__(self) -> bool:
        """A plan is in flight."""
        return bool(self._flights)

    @property
    def full(self) -> bool:
        return len(self._flights) >= self.depth

    async def send(self, plan: StepPlan, stats: StepStats, books: tuple[int, int]) -> None:
        """Send a plan; `books`: what the worker must report after it."""
        if self._reset_worker:
            plan, self._reset_worker = dataclasses.replace(plan, reset=True), False
        self._flights.append(InFlight(plan, stats, books))
        await self._wire.send(plan)

    async def receive(self) -> tuple[InFlight, StepResult]:
        """The oldest plan and its result, no later than the in-flight plans' deadline (a hung
        worker: WorkerFault)."""
        flight = self._flights[0]
        tokens = sum(len(f.plan.extends.token_ids) + len(f.plan.decodes) for f in self._flights)
        deadline = self._deadline_s(tokens)
        try:
            async with asyncio.timeout(deadline):  # no task per step, unlike wait_for
                result = await self._wire.receive()
        except TimeoutError:
            raise WorkerFault(f"no result for step {flight.plan.step_id} within {deadline:.1f} s") from None
        self._flights.popleft()
        return flight, result

    def forget(self) -> None:
        """The plans in flight were made by a scheduler since replaced: their results are dropped."""
        self._flights = deque(dataclasses.replace(f, stale=True) for f in self._flights)

    def reset_worker(self) -> None:
        """The next plan tells the worker to forget everything (what it holds belongs to a
        scheduler since replaced)."""
        self._reset_worker = True
