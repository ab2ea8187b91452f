"""`stepwise gateway --workers N`: N gateway processes serving one HTTP port, and their supervisor.

The supervisor (the process `stepwise gateway` started as) binds the port first, exclusively: a taken
port fails at once, `--port 0` picks a free one. It then sets SO_REUSEPORT on that socket without
listening on it, so it receives no connection yet holds the port for its workers only (a socket of
another user, or one without SO_REUSEPORT, cannot bind it). Each worker binds the same port with
SO_REUSEPORT and listens: the kernel spreads new connections over the listening workers by a hash
of the client's address and port, so a burst of connections is shared even while one worker is
busy, which one accept queue shared by all (uvicorn's own `--workers`) does not promise.

Each worker is the whole gateway (its own gRPC channel, limits, metrics): `--max-connections` and
the open-file limit are per worker. The supervisor serves nothing: it writes `--ready-file` once
every worker accepts connections, restarts a worker that exits (with backoff; its open
connections are lost, the others' are not), and on SIGTERM or SIGINT closes the port and SIGTERMs
every worker, each of which finishes its in-flight responses (uvicorn's graceful timeout) and exits;
then it exits 0 (130 for SIGINT, as one process would). A worker that exits before it accepts,
while the gateway starts, ends the whole gateway with an error instead: it would only exit again.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

import structlog

from gateway.app import GatewayConfig
from gateway.server import GRACEFUL_S

log = structlog.get_logger("stepwise.gateway")

# A worker process's entry: (config, host, port, index, log level, its end of the ready pipe, the
# supervisor's pid). The command line passes it in (stepwise/gateway_worker.py), so this package
# does not import the code that sets a process up (logging, dying with its parent).
WorkerEntry = Callable[[GatewayConfig, str, int, int, str, Connection, int], None]

# Restart delays after a worker exits: doubling from the first, capped at the last; a worker that
# lived HEALTHY_RUN_S before it exited restarts after the first again.
RESTART_BACKOFF_S = (0.5, 30.0)
HEALTHY_RUN_S = 60.0
# The time a worker gets past uvicorn's graceful shutdown (GRACEFUL_S) to close its channel and exit,
# before it is killed.
EXIT_MARGIN_S = 5.0
POLL_S = 0.2


class WorkerStartError(RuntimeError):
    """A worker exited or did not accept connections while the gateway started."""


def reserve_port(host: str, port: int) -> socket.socket:
    """The supervisor's hold on `host:port`: bound exclusively (OSError naming the address when it
    is taken), then open to the workers' SO_REUSEPORT binds. It never listens."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


def join_port(host: str, port: int) -> socket.socket:
    """A worker's own socket on the supervisor's port (SO_REUSEPORT), ready for uvicorn to listen on."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class Worker:
    """One worker process and its end of the ready pipe (it sends its pid once it accepts)."""

    def __init__(self, index: int, process: BaseProcess, ready: Connection) -> None:
        self.index, self.process, self.ready = index, process, ready
        self.started = time.monotonic()
        self.accepting = False

    @property
    def pid(self) -> int:
        assert self.process.pid is not None, "started"
        return self.process.pid


class Supervisor:
    """The N workers of one `stepwise gateway --workers N`."""

    def __init__(
        self,
        config: GatewayConfig,
        host: str,
        sock: socket.socket,
        workers: int,
        log_level: str,
        entry: WorkerEntry,
    ) -> None:
        self.config, self.host, self.sock = config, host, sock
        self.port: int = sock.getsockname()[1]
        self.count, self.log_level, self.entry = workers, log_level, entry
        self.workers: dict[int, Worker] = {}
        self._context = multiprocessing.get_context("spawn")
        self._delays: dict[int, float] = {}
        self._due: dict[int, float] = {}  # index -> when an exited worker starts again
        self._signals: list[int] = []

    # --- the whole life -------------------------------------------------------------------------

    def run(self, ready_file: Path | None, start_timeout: float = 60.0) -> int:
        """Start every worker, write `ready_file`, supervise until SIGTERM or SIGINT, then drain.

        WorkerStartError when a worker exits or does not accept within `start_timeout`."""
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                for index in range(self.count):
                    self._spawn(index)
                self._wait_accepting(start_timeout)
            except BaseException:
                self.stop()
                raise
            if not self._signals:
                if ready_file is not None:
                    write_ready(
                        ready_file, {"port": self.port, "pid": os.getpid(), "worker_pids": self.pids()}
                    )
                log.info("gateway workers accepting", port=self.port, workers=self.count, pids=self.pids())
                while not self._signals:
                    self._supervise(POLL_S)
            self.stop()
            return 130 if self._signals and self._signals[0] == signal.SIGINT else 0
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers.values() if w.process.is_alive()]

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals.append(sig)
        if len(self._signals) > 1:
            # A second signal: SIGINT makes uvicorn stop waiting for in-flight responses.
            self._signal_workers(signal.SIGINT)

    # --- starting and restarting ----------------------------------------------------------------

    def _spawn(self, index: int) -> None:
        ours, theirs = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=self.entry,
            args=(self.config, self.host, self.port, index, self.log_level, theirs, os.getpid()),
            name=f"stepwise-gateway-{index}",
            daemon=True,
        )
        process.start()
        theirs.close()
        self.workers[index] = Worker(index, process, ours)

    def _wait_accepting(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._signals and not all(w.accepting for w in self.workers.values()):
            for worker in self.workers.values():
                if not worker.accepting and not worker.process.is_alive() and not self._read_ready(worker):
                    code = worker.process.exitcode
                    raise WorkerStartError(
                        f"gateway worker {worker.index} exited with code {code} while starting"
                    )
            if time.monotonic() > deadline:
                waiting = sorted(w.index for w in self.workers.values() if not w.accepting)
                raise WorkerStartError(f"gateway workers {waiting} did not accept within {timeout:g} s")
            self._wait(POLL_S)

    def _wait(self, timeout: float) -> None:
        """Sleep until a worker sends its pid or exits, or `timeout` passes (or a signal comes)."""
        handles: list[object] = []
        for worker in self.workers.values():
            if worker.index in self._due:
                continue  # exited: its sentinel would wake us at once until it starts again
            handles.append(worker.process.sentinel)
            if not worker.accepting:
                handles.append(worker.ready)
        for handle in wait(handles, timeout):  # type: ignore[arg-type]
            for worker in self.workers.values():
                if handle is worker.ready:
                    self._read_ready(worker)

    def _read_ready(self, worker: Worker) -> bool:
        """Whether the worker said it accepts (reading what it sent, if anything)."""
        with contextlib.suppress(EOFError, OSError):
            if not worker.accepting and worker.ready.poll():
                worker.ready.recv()
                worker.accepting = True
                if worker.index in self._delays:
                    log.info("gateway worker accepting again", worker=worker.index, pid=worker.pid)
        return worker.accepting

    def _supervise(self, timeout: float) -> None:
        """Wait a while; report each worker that exited and start it again after its delay."""
        self._wait(timeout)
        now = time.monotonic()
        for index, worker in list(self.workers.items()):
            if index in self._due:
                if now >= self._due[index] and not self._signals:
                    del self._due[index]
                    worker.ready.close()
                    self._spawn(index)
                continue
            if worker.process.is_alive():
                continue
            worker.process.join(0)
            delay = self._next_delay(index, now - worker.started)
            self._due[index] = now + delay
            log.error(
                "gateway worker exited; restarting it",
                worker=index,
                pid=worker.pid,
                code=worker.process.exitcode,
                restart_in_s=delay,
            )

    def _next_delay(self, index: int, lived: float) -> float:
        first, cap = RESTART_BACKOFF_S
        previous = self._delays.get(index)
        delay = first if previous is None or lived >= HEALTHY_RUN_S else min(previous * 2, cap)
        self._delays[index] = delay
        return delay

    # --- stopping -------------------------------------------------------------------------------

    def stop(self, timeout: float = GRACEFUL_S + EXIT_MARGIN_S) -> None:
        """Close the port (new connections are refused once every worker has closed its own), SIGTERM
        every worker (each drains its in-flight responses, then exits), SIGKILL what is left after
        `timeout`."""
        self.sock.close()
        self._signal_workers(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for worker in self.workers.values():
            worker.process.join(max(deadline - time.monotonic(), 0.0))
            if worker.process.is_alive():
                log.error(
                    "gateway worker did not exit in time; killing it", worker=worker.index, pid=worker.pid
                )
                worker.process.kill()
                worker.process.join(1.0)
            worker.ready.close()

    def _signal_workers(self, sig: signal.Signals) -> None:
        for worker in list(self.workers.values()):  # a signal handler may run while _spawn adds one
            if worker.process.is_alive() and worker.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, sig)


def write_ready(path: Path, data: dict[str, object]) -> None:
    """Write `data` as JSON to `path` atomically: a reader never sees a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)
