"""`stepwise up`: control planes and N workers as child processes, supervised.

Every flag given to `up` is passed on to the child that knows it (both when both do; `up --help`
lists them by child), except the few `up` sets itself (SET_BY_UP), which it refuses. A worker (or
the gateway) that exits is started again with backoff, and its requests continue on the other
workers meanwhile; a control plane's exit, Ctrl-C or SIGTERM stops them all. Children die with the
parent (PR_SET_PDEATHSIG): no orphans. `--control-planes K` runs the many-control-plane shape of a
Kubernetes deployment on one machine: the workers dial all K and balance over them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from clients.client import StepwiseClient
from flagtypes import MAX_PROCESSES, PORT, Int
from flagtypes.table import Flag, Flags
from stepwise.flags import HelpSection, help_text
from stepwise.parent import PARENT_ENV

# `up --control-planes` at most: each is a core and its frontends, and K of them on one machine only
# stand for K pods of a deployment (more belong on more machines).
MAX_CONTROL_PLANES = 16
# Worker flags `up` sets itself: a value given to `up` would be replaced, so it is refused instead.
SET_BY_UP = ("--control", "--worker-id")
# The control plane's flags `up --gateway-port` gives the gateway too (gateway_args).
GATEWAY_FLAGS = ("--model", "--log-level")


# `up`'s own flags (the gateway's templates and --ready-file follow them in its --help).
UP_FLAGS = Flags(
    None,
    (
        Flag(
            "--workers",
            Int(0, MAX_PROCESSES),
            default=1,
            help="how many workers to start (each restarted if it exits)",
        ),
        Flag(
            "--control-planes",
            Int(1, MAX_CONTROL_PLANES),
            default=1,
            help="how many control planes to start (each with its own ports; workers balance over "
            "them and the client address lists them all)",
        ),
        Flag("--gateway-port", PORT, help="also start the OpenAI gateway on this port (0: any)"),
        Flag("--gateway-host", default="127.0.0.1", help="the gateway's HTTP bind address"),
        Flag(
            "--gateway-served-model-name",
            nargs="+",
            metavar="NAME",
            help="the model names the gateway accepts, the first the one it reports (its "
            "--served-model-name; a request naming another is a 404 model_not_found; default: the "
            "model's name, a Hub id without its revision, else the directory's name)",
        ),
        Flag(
            "--gateway-workers",
            Int(1, MAX_PROCESSES),
            default=1,
            help="gateway processes serving --gateway-port (its --workers)",
        ),
    ),
)


def split_flags(
    argv: Sequence[str], control: argparse.ArgumentParser, worker: argparse.ArgumentParser
) -> tuple[list[str], list[str]]:
    """Route each `--flag [value...]` group to the parser(s) that define it; ValueError for a flag
    neither knows, or one `up` sets itself (SET_BY_UP)."""
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
        if name in SET_BY_UP:
            raise ValueError(f"{name} is set by up itself for each worker (stepwise up --help)")
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


def passed_on_sections(
    up: argparse.ArgumentParser,
    control: argparse.ArgumentParser,
    worker: argparse.ArgumentParser,
    gateway: argparse.ArgumentParser,
) -> list[HelpSection]:
    """Where `up` passes each flag it does not parse itself, for its --help: read from the children's
    own parsers (split_flags routes by the same parsers), so the list cannot drift from them."""
    own = set(up._option_string_actions)
    to_control, to_worker = _passed_options(control, own), _passed_options(worker, own)
    gateway_actions = {s: a for a in gateway._actions for s in a.option_strings}
    return [
        HelpSection(
            "passed to the control plane (stepwise control)",
            "",
            tuple(a for name, a in to_control.items() if name not in to_worker),
        ),
        HelpSection(
            "passed to every worker (stepwise worker)",
            "",
            tuple(a for name, a in to_worker.items() if name not in to_control),
        ),
        HelpSection(
            "passed to the control plane and every worker",
            "each reads it as its own flag of that name",
            tuple(_both(to_control[name], to_worker[name]) for name in to_control if name in to_worker),
        ),
        HelpSection(
            "passed to the gateway too (with --gateway-port)",
            "as given to the control plane; --gateway-host and --gateway-port become the gateway's --host "
            "and --port",
            tuple(gateway_actions[name] for name in GATEWAY_FLAGS),
        ),
        HelpSection(
            "set by up itself",
            f"each worker's {' and '.join(SET_BY_UP)} (refused if given), each child's --ready-file, the "
            "gateway's --workers and --served-model-name (from --gateway-workers and "
            "--gateway-served-model-name); with "
            "--control-planes K > 1 also each control plane's --worker-port and --peers, and --port is "
            "the first of K consecutive client ports (0: any free ones)",
            (),
        ),
    ]


def _passed_options(parser: argparse.ArgumentParser, own: Collection[str]) -> dict[str, argparse.Action]:
    """`parser`'s long options that `up` passes on: not help, not `up`'s own, not SET_BY_UP."""
    options: dict[str, argparse.Action] = {}
    for action in parser._actions:
        name = next((s for s in action.option_strings if s.startswith("--")), None)
        if name is not None and name != "--help" and name not in own and name not in SET_BY_UP:
            options[name] = action
    return options


def _both(control: argparse.Action, worker: argparse.Action) -> argparse.Action:
    """One entry for a flag both children take, with each one's meaning when they differ."""
    shown = copy.copy(control)
    ours, theirs = help_text(control), help_text(worker)
    shown.help = ours if ours == theirs else f"control plane: {ours}; worker: {theirs}"
    shown.type = None  # the ranges are in the text already
    return shown


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


# A child that exits is started again after this delay, doubled per exit up to the cap; a child that
# ran this long before it exited starts over from the first delay.
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_CAP_S = 30.0
RESTART_RESET_AFTER_S = 60.0


@dataclass(slots=True)
class Child:
    """One child process of `up`, and when it may be restarted."""

    name: str
    args: list[str]
    # A control plane: its exit stops the stack. Workers and the gateway are restarted.
    critical: bool
    proc: subprocess.Popen[bytes]
    started: float
    restarts: int = 0
    backoff: float = RESTART_BACKOFF_S
    # When an exited child is started again (None: running).
    due: float | None = None


class Stack:
    """The child processes of one `up`: `control_planes` control planes, `workers` workers that
    balance over them, and optionally the OpenAI gateway."""

    def __init__(
        self,
        control_args: list[str],
        worker_args: list[str],
        workers: int,
        gateway_args: list[str] | None = None,
        control_planes: int = 1,
        each_worker_args: Sequence[Sequence[str]] = (),
        log_path: Path | None = None,
    ) -> None:
        self.control_args = control_args
        self.worker_args = worker_args
        # Flags of worker i beyond worker_args (e.g. its --role), for the first len(...) workers.
        self.each_worker_args = [list(a) for a in each_worker_args]
        self.workers = workers
        self.control_planes = control_planes
        # None: no gateway; else `stepwise gateway` flags (`--control` and `--ready-file` are added).
        self.gateway_args = gateway_args
        self.children: list[Child] = []
        # The client address: HOST:PORT, or a comma list of them with several control planes.
        self.address = ""
        self.addresses: list[str] = []
        self.gateway_address = ""
        self._tmp = tempfile.TemporaryDirectory(prefix="stepwise-up-")
        # Where the children's output goes, when not to the terminal (`stepwise chat`): then they
        # also run in a session of their own, so the terminal's Ctrl-C, meant for the conversation,
        # does not reach them.
        self.log_path = log_path

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        """The current processes: control planes, then workers, then the gateway."""
        return [child.proc for child in self.children]

    def _spawn(self, name: str, args: list[str], critical: bool = False) -> Child:
        child = Child(name, args, critical, self._popen(args), time.monotonic())
        self.children.append(child)
        return child

    def _popen(self, args: list[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        command = [sys.executable, "-m", "stepwise.cli", *args]
        if self.log_path is None:
            return subprocess.Popen(command, env=env)
        with self.log_path.open("ab") as log:
            return subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )

    async def start(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        ports = await self._start_control_planes(deadline)
        worker_ports = ",".join(f"127.0.0.1:{p['worker_port']}" for p in ports)
        for i in range(self.workers):
            own = self.each_worker_args[i] if i < len(self.each_worker_args) else []
            args = [
                "worker",
                *self.worker_args,
                *own,
                "--control",
                worker_ports,
                "--worker-id",
                f"worker-{i}",
            ]
            self._spawn(f"worker-{i}", args)
        self.addresses = [f"127.0.0.1:{p['port']}" for p in ports]
        self.address = ",".join(self.addresses)
        await self._wait_workers(deadline)
        if self.gateway_args is not None:
            await self._start_gateway(deadline)
        return self.address

    async def _start_control_planes(self, deadline: float) -> list[dict[str, int]]:
        """Start every control plane and wait for each one's ports. With several, each gets a port of
        its own (consecutive from --port, or any free one for --port 0), a free worker port, and the
        others' worker ports as its --peers, so they balance the workers between them."""
        extra: list[list[str]] = [[] for _ in range(self.control_planes)]
        if self.control_planes > 1:
            base = int(_flag_value(self.control_args, "--port") or 50051)
            clients = [base + i if base else 0 for i in range(self.control_planes)]
            workers = free_ports(self.control_planes, avoid=set(clients))
            peers = ",".join(f"127.0.0.1:{port}" for port in workers)
            extra = [
                ["--port", str(c), "--worker-port", str(w), "--peers", peers]
                for c, w in zip(clients, workers, strict=True)
            ]
        readies = []
        for i in range(self.control_planes):
            ready = Path(self._tmp.name) / f"ready-{i}.json"
            args = ["control", *self.control_args, *extra[i], "--ready-file", str(ready)]
            self._spawn(f"control-{i}" if self.control_planes > 1 else "control", args, critical=True)
            readies.append(ready)
        return [
            await _read_ready(child, ready, deadline, "control plane")
            for child, ready in zip(self.children, readies, strict=True)
        ]

    async def _start_gateway(self, deadline: float) -> None:
        """Start `stepwise gateway` in front of the control planes; wait until it accepts HTTP."""
        ready = Path(self._tmp.name) / "gateway.json"
        args = [*(self.gateway_args or []), "--control", self.address, "--ready-file", str(ready)]
        gateway = self._spawn("gateway", ["gateway", *args])
        port = (await _read_ready(gateway, ready, deadline, "gateway"))["port"]
        host = _flag_value(self.gateway_args or [], "--host") or "127.0.0.1"
        self.gateway_address = f"{host}:{port}"

    def reload(self) -> None:
        """SIGHUP to `up`: each control plane rereads its tenant file (docs/deploy.md#tenants), as a
        control plane run alone does on its own SIGHUP."""
        for child in self.children:
            if child.critical and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGHUP)

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

    async def attached(self) -> list[int]:
        """Workers attached to each control plane, in order."""
        counts = []
        for address in self.addresses:
            async with StepwiseClient(address, api_key=self.api_key()) as client:
                counts.append(len((await client.server_info()).workers))
        return counts

    async def _wait_workers(self, deadline: float) -> None:
        for address in self.addresses:
            async with StepwiseClient(address, api_key=self.api_key()) as client:
                await client.wait_ready(max(deadline - time.monotonic(), 1.0))
        while sum(await self.attached()) < self.workers:
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not attach")
            await asyncio.sleep(0.1)

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"child {proc.pid} exited with code {proc.returncode}")

    def supervise(self, now: float | None = None) -> str | None:
        """Restart workers and the gateway that exited (with backoff); returns why the stack must stop
        (a control plane exited), else None. Call it now and then."""
        now = time.monotonic() if now is None else now
        for child in self.children:
            code = child.proc.poll()
            if code is None:
                continue
            if child.critical:
                return f"{child.name} exited with code {code}"
            if child.due is None:
                if now - child.started >= RESTART_RESET_AFTER_S:
                    child.backoff = RESTART_BACKOFF_S
                child.due = now + child.backoff
                print(
                    f"stepwise up: {child.name} exited with code {code}; restarting in {child.backoff:g} s",
                    file=sys.stderr,
                    flush=True,
                )
                child.backoff = min(child.backoff * 2, RESTART_BACKOFF_CAP_S)
            elif now >= child.due:
                child.proc, child.started, child.due = self._popen(child.args), now, None
                child.restarts += 1
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGINT the gateway, the workers, then the control planes (stop now, no drain); SIGKILL
        whatever is left after the timeout."""
        stop_processes(self.procs, timeout)
        self._tmp.cleanup()


def local_stack(model_dir: Path, log_path: Path | None = None) -> Stack:
    """A control plane and one worker on `model_dir`, on 127.0.0.1 and ephemeral ports, logging
    warnings only (to `log_path` when given): what `stepwise demo` and `stepwise chat` start for
    themselves."""
    model = ["--model", str(model_dir)]
    control = ["--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]
    return Stack([*control, *model], ["--log-level", "warning", *model], workers=1, log_path=log_path)


async def _read_ready(child: Child, ready: Path, deadline: float, what: str) -> dict[str, int]:
    """What `child` wrote to its --ready-file once it is up; RuntimeError if it exits first,
    TimeoutError past the deadline."""
    while not ready.exists():
        if child.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {child.proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not start")
        await asyncio.sleep(0.05)
    return json.loads(ready.read_text())  # type: ignore[no-any-return]


def free_ports(count: int, avoid: Collection[int] = ()) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 right now (and not in `avoid`)."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if port not in avoid:
                ports.append(port)
    finally:
        for sock in socks:
            sock.close()
    return ports


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag VALUE` or `flag=VALUE` in `args` (the last one wins), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def gateway_args(
    control_args: Sequence[str],
    host: str,
    port: int,
    served_model_name: str | Sequence[str] | None = None,
    workers: int = 1,
) -> list[str]:
    """`stepwise gateway` flags for `up --gateway-port`: the control plane's model and log level,
    `--gateway-served-model-name` and `--gateway-workers`."""
    args = ["--host", host, "--port", str(port)]
    for flag in GATEWAY_FLAGS:
        value = _flag_value(control_args, flag)
        if value is not None:
            args += [flag, value]
    if served_model_name:
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        args += ["--served-model-name", *names]
    # Always given: the gateway would otherwise read STEPWISE_WORKERS, which is `up --workers`' too.
    return [*args, "--workers", str(workers)]


def stop_processes(
    procs: Sequence[subprocess.Popen[bytes]], timeout: float = 10.0, sig: signal.Signals = signal.SIGINT
) -> None:
    """Signal the processes last to first (a stopped one is continued first, so it can hear it),
    then SIGKILL whatever is left after `timeout` seconds.

    SIGINT by default: stop now. A control plane ends its streams with an abort rather than drain
    them as on SIGTERM (which may take its --drain-timeout), and a worker whose control plane is
    gone exits at once."""
    for proc in reversed(procs):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(sig)
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
    """Start, print the address, then supervise until a signal or a control plane's exit."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # Passed on, not the default (which ends `up` and leaves its children running).
    loop.add_signal_handler(signal.SIGHUP, stack.reload)
    try:
        try:
            address = await stack.start()
        except (RuntimeError, TimeoutError) as exc:  # a child that died or never came up: one line
            print(f"stepwise up: cannot start: {exc}", file=sys.stderr)
            return 2
        gateway = f", OpenAI gateway http://{stack.gateway_address}/v1" if stack.gateway_address else ""
        planes = f"{stack.control_planes} control planes, " if stack.control_planes > 1 else ""
        print(
            f"stepwise is up: client address {address} ({planes}{stack.workers} worker(s){gateway}); "
            "Ctrl-C stops it",
            flush=True,
        )
        if ready_file is not None:
            write_ready(ready_file, {"address": address, "gateway_address": stack.gateway_address})
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
            why = stack.supervise()
            if why is not None:
                print(f"stepwise up: {why}; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        stack.stop()
        os.environ.pop("STEPWISE_UP", None)
