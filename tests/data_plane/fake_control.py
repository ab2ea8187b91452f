"""Fake control planes for worker tests: grpc.aio WorkerLink servers on loopback whose Connect
streams follow a script and whose Census answers what the test says; and ways to run a worker
against them (a subprocess, or `data_plane.worker.serve` in this process on the sim backend).

    async with fake_control(welcome_then(SHUTDOWN), census=Census(workers=2)) as control:
        ...control.port, control.sessions[0].results...
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

import grpc

from data_plane.config import WorkerConfig
from data_plane.kv_transfer import TransferStore
from data_plane.link import Link
from data_plane.worker import LoadedWorker, load_sim_worker, serve
from protos import worker_codec
from protos.stepwise.v1 import worker_pb2, worker_pb2_grpc
from protos.worker import Census, Move, Shutdown, StepPlan, Welcome
from tests.data_plane.factories import Extend, SlotAllocator, make_plan, new_seq
from tests.polling import until

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPT = [464, 300, 42, 17, 99, 5]
# Longest a test waits for anything the worker should do.
WAIT_S = 30.0


@dataclass
class Session:
    """What a fake control plane saw on one Connect stream."""

    hello: worker_pb2.Hello | None = None
    results: list[worker_pb2.StepResult] = field(default_factory=list)
    drains: list[str] = field(default_factory=list)
    # The worker's reports of transfers it holds: (transfer id, bytes), in order.
    received: list[tuple[str, int]] = field(default_factory=list)
    hello_seen: asyncio.Event = field(default_factory=asyncio.Event)
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    # The worker ended its side of the stream cleanly (done_writing), not by cancelling it.
    half_closed: asyncio.Event = field(default_factory=asyncio.Event)
    _arrived: asyncio.Queue[worker_pb2.StepResult] = field(default_factory=asyncio.Queue)

    async def next_result(self) -> worker_pb2.StepResult:
        return await asyncio.wait_for(self._arrived.get(), WAIT_S)

    async def collect(self, requests: AsyncIterator[worker_pb2.WorkerMessage]) -> None:
        async for message in requests:
            kind = message.WhichOneof("msg")
            if kind == "result":
                self.results.append(message.result)
                self._arrived.put_nowait(message.result)
            elif kind == "drain":
                self.drains.append(message.drain.reason)
                self.drained.set()
            elif kind == "received":
                self.received.append((message.received.transfer_id, message.received.bytes))
        self.half_closed.set()


Script = Callable[[Session], AsyncIterator[worker_pb2.ControlMessage]]


class FakeControl(worker_pb2_grpc.WorkerLinkServicer):
    """Session i follows scripts[i] (the last one repeats). `census` None: Census is UNIMPLEMENTED."""

    def __init__(self, scripts: Sequence[Script], census: Census | None) -> None:
        self.scripts = scripts
        self.census = census
        self.sessions: list[Session] = []
        # The hello each census request asked about (None: counts only), in order.
        self.census_hellos: list[worker_pb2.Hello | None] = []
        self.port = 0
        self.server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def Census(self, request, context):  # type: ignore[no-untyped-def]
        self.census_hellos.append(worker_codec.census_hello(request))
        if self.census is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Census here")
        return worker_codec.census_to_proto(self.census)

    async def Connect(self, request_iterator, context):  # type: ignore[no-untyped-def]
        session = Session()
        script = self.scripts[min(len(self.sessions), len(self.scripts) - 1)]
        self.sessions.append(session)
        session.hello = (await anext(aiter(request_iterator))).hello
        session.hello_seen.set()
        collector = asyncio.create_task(session.collect(request_iterator))
        try:
            async for message in script(session):
                yield message
        finally:
            collector.cancel()

    async def stop(self) -> None:
        """Stop serving now (active streams are cancelled), as a control plane that dies."""
        if self.server is not None:
            await self.server.stop(grace=None)

    async def session(self, index: int = 0) -> Session:
        """Session `index` once the worker said hello on it."""
        await until(lambda: len(self.sessions) > index, WAIT_S, f"session {index}")
        await asyncio.wait_for(self.sessions[index].hello_seen.wait(), WAIT_S)
        return self.sessions[index]


@contextlib.asynccontextmanager
async def fake_control(
    *scripts: Script,
    port: int = 0,
    census: Census | None = Census(),  # noqa: B008 (frozen)
    server_credentials: grpc.ServerCredentials | None = None,
) -> AsyncIterator[FakeControl]:
    servicer = FakeControl(scripts or (welcome_then(SHUTDOWN),), census)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerLinkServicer_to_server(servicer, server)
    where = f"127.0.0.1:{port}"
    if server_credentials is None:
        servicer.port = server.add_insecure_port(where)
    else:
        servicer.port = server.add_secure_port(where, server_credentials)
    await server.start()
    servicer.server = server
    try:
        yield servicer
    finally:
        await servicer.stop()


def free_port() -> int:
    """A port nothing listens on (at the moment of asking)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# ---- messages and scripts ----------------------------------------------------------------------


def welcome(
    accepted: bool = True, reason: str = "", retryable: bool = False, transfer_reports: bool = False
) -> worker_pb2.ControlMessage:
    return worker_codec.control_to_proto(Welcome(accepted, reason, retryable, transfer_reports))


def plan_message(plan: StepPlan) -> worker_pb2.ControlMessage:
    return worker_codec.plan_to_proto(plan)


SHUTDOWN = worker_codec.control_to_proto(Shutdown("test over"))
MOVE = worker_codec.control_to_proto(Move("rebalance"))


def two_step_plans() -> list[StepPlan]:
    """A prefill of PROMPT for handle 1, then one decode: what a fresh session may start with."""
    slots = SlotAllocator(1024, page_size=4, seed=5)
    prefill = make_plan(
        100, new_seqs=[new_seq(1)], extends=[Extend(1, 0, PROMPT, slots.alloc(1, len(PROMPT)))]
    )
    return [prefill, make_plan(101, decodes=[(1, int(slots.alloc(1, 1)[0]))])]


def run_plans_then(last: worker_pb2.ControlMessage | None) -> Script:
    """Welcome, send each of two_step_plans() and wait for its result, then send `last` (None: end
    the stream)."""

    async def script(session: Session) -> AsyncIterator[worker_pb2.ControlMessage]:
        yield welcome()
        for plan in two_step_plans():
            yield plan_message(plan)
            await session.next_result()
        if last is not None:
            yield last

    return script


def welcome_then(*messages: worker_pb2.ControlMessage, hold_s: float = 0.0) -> Script:
    """Welcome, the messages, then keep the stream open `hold_s` seconds."""

    async def script(session: Session) -> AsyncIterator[worker_pb2.ControlMessage]:
        yield welcome()
        for message in messages:
            yield message
        await asyncio.sleep(hold_s)

    return script


def hold(seconds: float = WAIT_S) -> Script:
    """Welcome, then nothing for `seconds`."""
    return welcome_then(hold_s=seconds)


def tokens(result: worker_pb2.StepResult) -> list[int]:
    return worker_codec.result_from_proto(result).token_ids.tolist()


# ---- workers -----------------------------------------------------------------------------------


def sim_config(model_dir: pathlib.Path, control: str, **overrides: object) -> WorkerConfig:
    """A sim-backend worker config with test-sized timeouts."""
    config = WorkerConfig(
        control=control,
        model=model_dir,
        backend="sim",
        kv_tokens=1024,
        worker_id="test-worker",
        connect_timeout_s=10.0,
        reconnect_max_backoff_s=0.2,
    )
    return replace(config, **overrides)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def serving(
    model_dir: pathlib.Path,
    control: str,
    link: Link | None = None,
    received: TransferStore | None = None,
    **overrides: object,
) -> AsyncIterator[asyncio.Task[int]]:
    """`serve` for a sim worker in this process, as a task (cancelled at the end if still running);
    `received`: the store of its KV transfer link (none is served: the test fills the store)."""
    config = sim_config(model_dir, control, **overrides)
    worker: LoadedWorker = replace(load_sim_worker(config), received=received)
    task = asyncio.create_task(serve(worker, config, link))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def served(task: asyncio.Task[int]) -> int:
    """The exit code `serve` returns (TimeoutError if it does not within WAIT_S)."""
    return await asyncio.wait_for(task, WAIT_S)


@contextlib.asynccontextmanager
async def worker_process(
    model_dir: pathlib.Path, control: int | str, *extra: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`python -m data_plane.worker` on the CPU; `control` is a port on 127.0.0.1 or a --control value."""
    target = f"127.0.0.1:{control}" if isinstance(control, int) else control
    args = ["--control", target, "--model", str(model_dir), "--device", "cpu"]
    args += ["--kv-tokens", "1024", "--worker-id", "test-worker", *extra]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "data_plane.worker", *args, cwd=REPO_ROOT, stderr=asyncio.subprocess.PIPE
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def read_log_until(proc: asyncio.subprocess.Process, text: str, timeout_s: float = 60.0) -> str:
    """Read the worker's stderr up to and including the first line containing `text`; what was read."""
    assert proc.stderr is not None
    lines: list[bytes] = []
    async with asyncio.timeout(timeout_s):
        while not lines or text.encode() not in lines[-1]:
            line = await proc.stderr.readline()
            assert line, f"stderr ended before {text!r}: {b''.join(lines).decode(errors='replace')}"
            lines.append(line)
    return b"".join(lines).decode(errors="replace")


async def exit_code(proc: asyncio.subprocess.Process, timeout_s: float = 60.0) -> tuple[int, str]:
    _, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, stderr.decode(errors="replace")
