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

    def __init__(
        self,
        control_args: list[str],
        worker_args: list[str],
        workers: int,
        gateway_args: list[str] | None = None,
    ) -> None:
        self.control_args = control_args
        self.worker_args = worker_args
        self.workers = workers
        # None: no gateway; else `stepwise gateway` flags (`--control` and `--ready-file` are added).
        self.gateway_args = gateway_args
        self.procs: list[subprocess.Popen[bytes]] = []
        self.address = ""
        self.gateway_address = ""
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
        if self.gateway_args is not None:
            await self._start_gateway(deadline)
        return self.address

    async def _start_gateway(self, deadline: float) -> None:
        """Start `stepwise gateway` in front of the control plane; wait until it accepts HTTP."""
        ready = Path(self._tmp.name) / "gateway.json"
        args = [*(self.gateway_args or []), "--control", self.address, "--ready-file", str(ready)]
        gateway = self._spawn(["gateway", *args])
        while not ready.exists():
            if gateway.poll() is not None:
                raise RuntimeError(f"gateway exited with code {gateway.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("gateway did not start")
            await asyncio.sleep(0.05)
        host = _flag_value(self.gateway_args or [], "--host") or "127.0.0.1"
        self.gateway_address = f"{host}:{json.loads(ready.read_text())['port']}"

    def api_key(self) -> str | None:
        """The key `up` itself uses to ask the control plane about its workers (--api-key or the
        first key of --api-key-file, as given to the control plane; else STEPWISE_API_KEY)."""
        from control_plane.config import read_api_keys

        key = _flag_value(self.control_args, "--api-key")
        if key:
            return key
        key_file = _flag_value(self.control_args, "--api-key-file")
        if key_file:
            return next(iter(read_api_keys(Path(key_file))), None)
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


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag VALUE` or `flag=VALUE` in `args` (the last one wins), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def gateway_args(control_args: Sequence[str], host: str, port: int) -> list[str]:
    """`stepwise gateway` flags for `up --gateway-port`: the control plane's model and log level."""
    args = ["--host", host, "--port", str(port)]
    for flag in ("--model", "--log-level"):
        value = _flag_value(control_args, flag)
        if value is not None:
            args += [flag, value]
    return args


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


def write_ready(path: Path, data: dict[str, object]) -> None:
    """Write `data` as JSON to `path` atomically: a reader never sees a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


async def run_up(stack: Stack, ready_file: Path | None = None) -> int:
    """Start, print the address, then wait for a signal or a child's exit; stop everything."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        address = await stack.start()
        gateway = f", OpenAI gateway http://{stack.gateway_address}/v1" if stack.gateway_address else ""
        print(
            f"stepwise is up: client address {address} ({stack.workers} worker(s){gateway}); Ctrl-C stops it",
            flush=True,
        )
        if ready_file is not None:
            write_ready(ready_file, {"address": address, "gateway_address": stack.gateway_address})
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
