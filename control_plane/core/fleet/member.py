"""What the fleet reads of one worker's engine, and tells it (core/engine.py is the one; tests and
a simulator bring their own). The fleet decides; the engine acts (`start_move`, `destination_gone`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from control_plane.core.fleet.balance import Room
from control_plane.core.fleet.placement import Call
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import WorkerLimits


class Member(Protocol):
    @property
    def worker(self) -> str: ...

    @property
    def limits(self) -> WorkerLimits: ...

    @property
    def serving(self) -> bool:
        """New requests may come here (not leaving, loop not ended)."""
        ...

    @property
    def leaving(self) -> object | None:
        """The drain or move under way (None: the worker stays)."""
        ...

    @property
    def attached_at(self) -> float: ...

    @property
    def steps(self) -> int:
        """Steps this worker completed (the test knob moves a call every so many)."""
        ...

    @property
    def scheduler(self) -> Scheduler:
        """Its scheduler (the router reads its radix tree: the prefix each worker caches)."""
        ...

    def load(self) -> tuple[int, int]:
        """(queued, running)."""
        ...

    def room(self, steps: int) -> Room:
        """Its KV once its running requests have decoded `steps` more."""
        ...

    def calls(self, steps: int, by_retraction: bool) -> Iterable[Call]:
        """Its live calls (in the order a retraction would release them, or as they came)."""
        ...

    def balancing(self) -> bool:
        """A move it started for KV room has not had its outcome yet."""
        ...

    def heading(self) -> Counter[str]:
        """Samples moving from here whose copy has had no outcome yet, by destination worker."""
        ...

    def knows(self, rid: str) -> bool: ...

    def stop(self) -> None: ...

    def destination_gone(self, worker: str, why: str) -> None:
        """`worker` left or was lost: every copy from here to it fails now."""
        ...
