"""Plain members for the fleet's tests: what a fleet reads of a worker's engine, as values."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from control_plane.core.fleet import Call, Room
from protos.worker import WorkerLimits


@dataclass
class FakeMember:
    worker: str
    role: str = "mixed"
    queued: int = 0
    running: int = 0
    headroom: int = 1000
    capacity: int = 1000
    live: list[Call] = field(default_factory=list)
    serving: bool = True
    transfer: bool = True
    steps: int = 1
    underway: bool = False
    attached_at: float = 0.0
    leaving: object | None = None
    scheduler: object = None
    # Samples moving from here, by destination, whose copies have had no outcome.
    moving_to: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        address = f"{self.worker}:1" if self.transfer else ""
        self.limits = WorkerLimits(
            self.worker, self.capacity, 1, 2048, 100, transfer_address=address, role=self.role
        )

    def load(self) -> tuple[int, int]:
        return self.queued, self.running

    def room(self, steps: int) -> Room:
        return Room(self.headroom, self.capacity, self.queued)

    def calls(self, steps: int, by_retraction: bool) -> Iterable[Call]:
        return iter(self.live)

    def balancing(self) -> bool:
        return self.underway

    def heading(self) -> Counter[str]:
        return self.moving_to

    def destination_gone(self, worker: str, why: str) -> None:
        self.moving_to.pop(worker, None)

    def knows(self, rid: str) -> bool:
        return any(rid in c.rids for c in self.live)

    def stop(self) -> None:
        self.serving = False
