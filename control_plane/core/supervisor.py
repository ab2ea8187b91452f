"""The frontend processes of one control plane: started on the shared client port, watched, and
restarted when one dies (its clients get UNAVAILABLE; the core aborts its requests; the others go on).
One that stalls (it stops answering the hub's heartbeat: core/heartbeat.py) is killed first.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

import structlog

from control_plane.config import ControlConfig
from control_plane.listen import PortGuard

log = structlog.get_logger("stepwise.supervisor")

# Restart delays after a frontend dies: doubling from the first, capped at the last.
RESTART_BACKOFF_S = (0.5, 30.0)
# A frontend that lived this long before dying restarts after the shortest delay again.
HEALTHY_RUN_S = 60.0


# A frontend process's entry: (config, index, link path, client port, log level, core pid). The
# command line passes it in (stepwise/frontend.py), so the core never imports the frontend's code.
FrontendEntry = Callable[[ControlConfig, int, str, int, str, int], None]


class FrontendStartError(RuntimeError):
    """A frontend could not start (its exit code says why in the log)."""


class Frontends:
    """K frontend processes. `start` returns the client port once every one of them listens."""

    def __init__(
        self, config: ControlConfig, link_path: str, log_level: str, entry: FrontendEntry | None = None
    ) -> None:
        self.config = config
        self.entry = entry
        self.link_path = link_path
        self.log_level = log_level
        self.port = 0
        self.processes: dict[int, BaseProcess] = {}
        self._started_at: dict[int, float] = {}
        self._delays: dict[int, float] = {}
        self._context = multiprocessing.get_context("spawn")
        self._stopping = False
        self._restarts: set[asyncio.Task[None]] = set()

    async def start(self, connected: asyncio.Queue[tuple[int, int]], timeout: float = 60.0) -> int:
        """Hold the port, start every frontend, wait until each has dialled the core (a frontend
        listens before it dials), then let the port go to them."""
        guard = PortGuard(self.config.host, self.config.port)
        self.port = guard.port
        try:
            for index in range(self.config.frontends):
                self._spawn(index)
            await self._wait_connected(connected, timeout)
        except BaseException:
            await self.stop()
            raise
        finally:
            guard.release()
        return self.port

    async def _wait_connected(self, connected: asyncio.Queue[tuple[int, int]], timeout: float) -> None:
        waiting = set(self.processes)
        deadline = time.monotonic() + timeout
        while waiting:
            dead = [i for i in waiting if not self.processes[i].is_alive()]
            if dead:
                code = self.processes[dead[0]].exitcode
                raise FrontendStartError(f"frontend {dead[0]} exited with code {code} while starting")
            if time.monotonic() > deadline:
                raise FrontendStartError(f"frontends {sorted(waiting)} did not start within {timeout:.0f} s")
            with contextlib.suppress(TimeoutError):
                index, _pid = await asyncio.wait_for(connected.get(), 0.2)
                waiting.discard(index)

    def _spawn(self, index: int) -> None:
        if self.entry is None:
            raise FrontendStartError("no frontend entry point was given to start frontend processes with")
        process = self._context.Process(
            target=self.entry,
            args=(self.config, index, self.link_path, self.port, self.log_level, os.getpid()),
            name=f"stepwise-frontend-{index}",
            daemon=True,
        )
        process.start()
        self.processes[index] = process
        self._started_at[index] = time.monotonic()
        asyncio.get_running_loop().add_reader(process.sentinel, self._exited, index, process)

    def _exited(self, index: int, process: BaseProcess) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(process.sentinel)
        process.join(0)
        if self._stopping or self.processes.get(index) is not process:
            return
        lived = time.monotonic() - self._started_at[index]
        delay = self._next_delay(index, lived)
        log.error("frontend exited; restarting it", frontend=index, code=process.exitcode, restart_in_s=delay)
        task = loop.create_task(self._restart(index, delay))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    def _next_delay(self, index: int, lived: float) -> float:
        first, cap = RESTART_BACKOFF_S
        previous = self._delays.get(index)
        delay = first if previous is None or lived >= HEALTHY_RUN_S else min(previous * 2, cap)
        self._delays[index] = delay
        return delay

    async def _restart(self, index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self._stopping:
            self._spawn(index)

    def kill(self, index: int, pid: int) -> None:
        """SIGKILL a stalled frontend (SIGKILL ends a stopped process too); its exit restarts it
        after the usual backoff. Nothing happens when that process is gone or was replaced."""
        process = self.processes.get(index)
        if process is None or process.pid != pid or not process.is_alive():
            return
        process.kill()  # the hub logged why

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values() if p.pid is not None and p.is_alive()]

    async def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM every frontend (they finish their streams' last messages), SIGKILL stragglers."""
        self._stopping = True
        for task in self._restarts:
            task.cancel()
        loop = asyncio.get_running_loop()
        for process in self.processes.values():
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(process.sentinel)
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            while process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if process.is_alive():
                process.kill()
            process.join(1.0)
