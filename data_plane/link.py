"""The worker's standing with the control planes: attached or not, draining or not.

The session marks the worker attached while it runs a welcomed session; a stop signal marks it
draining (for good: a draining worker finishes its session and exits). Readiness, the health
service "stepwise.v1.WorkerLink", follows: SERVING while attached and not draining.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from data_plane.health import WorkerHealth


class Link:
    """Read and changed only on the event loop's thread."""

    def __init__(self, health: WorkerHealth | None = None) -> None:
        self.health = health or WorkerHealth()
        self.attached = False
        # Set once, by drain(): the session then tells its control plane, and no new one starts.
        self.draining = asyncio.Event()
        self.drain_reason = ""

    @contextlib.asynccontextmanager
    async def attachment(self) -> AsyncIterator[None]:
        """Attached for the duration of the block (a welcomed session)."""
        self.attached = True
        await self._publish()
        try:
            yield
        finally:
            self.attached = False
            await self._publish()

    async def drain(self, reason: str) -> None:
        self.drain_reason = reason
        self.draining.set()
        await self._publish()

    async def _publish(self) -> None:
        await self.health.set_ready(self.attached and not self.draining.is_set())
