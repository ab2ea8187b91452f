"""`stepwise up`: a control plane and N workers as child processes, stopped together.

Every flag given to `up` is passed on to the child that knows it (both when both do). Children
die with the parent (PR_SET_PDEATHSIG), and Ctrl-C / SIGTERM stop them all: no orphans.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from clients.client import StepwiseClient
from stepwise.parent import PARENT_ENV


def split_flags(
    argv: Sequence[str], control: argparse.ArgumentParser, worker: argparse.ArgumentParser
) -> tuple[list[str], list[str]]:
    """Route each `--flag [value...]` group to the parser(s) that define it."""
    control_opts = set(control._option_string_actions)
    worker_opts = set(worker._option_string_actions)
    to_control: list[str] = []
    to_worker: list[str] = []
    group: list[str] = []

    def flush() -> None:
        if not group:
            return
        name = group[0].split("=", 1)[0]
        if name not in control_opts and name not in worker_opts:
            raise ValueError(f"unknown flag {name}")
        if name in control_opts:
            to_control.extend(group)
        if name in worker_opts:
            to_worker.extend(group)
        group.clear()

    for token in argv:
        if token.startswith("-") and not _is_number(token):
            flush()
        elif not group:
            raise ValueError(f"unexpected argument {token!r}")
        group.append(token)
    flush()
    return to_control, to_worker


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


class Stack:
    """The child processes of one `up`."""

    def __init__(self, control_args: list[str], worker_args: list[str], workers: int) -> None:
        self.control_args = control_args
        self.worker_args = worker_args
        self.workers = workers
        self.procs: list[subprocess.Popen[bytes]] = []
        self.address = ""
        self._tmp = tempfile.TemporaryDirectory(prefix="stepwise-up-")

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        proc = subprocess.Popen([sys.executable, "-m", "stepwise.cli", *args], env=env)
        self.procs.append(proc)
        return proc

    async def start(self, timeout: float = 120.0) -> str:
        ready = Path(self._tmp.name) / "ready.json"
        control = self._spawn(["control", *self.control_args, "--ready-file", str(ready)])
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if control.poll() is not None:
                raise RuntimeError(f"control plane exited with code {control.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("control plane did not start")
            await asyncio.sleep(0.05)
        ports = json.loads(ready.read_text())
        for i in range(self.workers):
            self._spawn(
                [
                    "worker",
                    *self.worker_args,
                    "--control",
                    f"127.0.0.1:{ports['worker_port']}",
                    "--worker-id",
                    f"worker-{i}",
                ]
            )
        self.address = f"127.0.0.1:{ports['port']}"
        await self._wait_workers(deadline)
        return self.address

    def api_key(self) -> str | None:
        """The key `up` itself uses to ask the control plane about its workers (--api-key or the
        first key of --api-key-file, as given to the control plane; else STEPWISE_API_KEY)."""
        args = self.control_args
        for i, arg in enumerate(args[:-1]):
            if arg == "--api-key":
                return args[i + 1]
            if arg == "--api-key-file":
                lines = Path(args[i + 1]).read_text().splitlines()
                return next((k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")), None)
        return os.environ.get("STEPWISE_API_KEY") or None

    async def _wait_workers(self, deadline: float) -> None:
        async with StepwiseClient(self.address, api_key=self.api_key()) as client:
            await client.wait_ready(max(deadline - time.monotonic(), 1.0))
            while len((await client.server_info()).workers) < self.workers:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError("workers did not attach")
                await asyncio.sleep(0.1)

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"child {proc.pid} exited with code {proc.returncode}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM workers then the control plane; SIGKILL whatever is left after the timeout."""
        stop_processes(self.procs, timeout)
        self._tmp.cleanup()


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], timeout: float = 10.0) -> None:
    """SIGTERM the processes last to first (a stopped one is continued first, so it can hear it),
    then SIGKILL whatever is left after `timeout` seconds."""
    for proc in reversed(procs):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def run_up(stack: Stack) -> int:
    """Start, print the address, then wait for a signal or a child's exit; stop everything."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        address = await stack.start()
        print(
            f"stepwise is up: client address {address} ({stack.workers} worker(s)); Ctrl-C stops it",
            flush=True,
        )
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            if any(p.poll() is not None for p in stack.procs):
                print("stepwise up: a child process exited; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        stack.stop()
        os.environ.pop("STEPWISE_UP", None)
