"""The worker as a real process against a fake control plane (grpc.aio WorkerLink on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest

from data_plane import codec
from data_plane.messages import StepPlan
from data_plane.models.loader import model_fingerprint
from protos.stepwise.v1 import worker_pb2, worker_pb2_grpc
from tests.data_plane.factories import Extend, SlotAllocator, make_plan, new_seq

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPT = [464, 300, 42, 17, 99, 5]
PROCESS_TIMEOUT_S = 60


@dataclass
class Session:
    """What the fake control plane saw on one Connect stream."""

    hello: worker_pb2.Hello | None = None
    results: list[worker_pb2.StepResult] = field(default_factory=list)
    hello_seen: asyncio.Event = field(default_factory=asyncio.Event)


Replies = AsyncIterator[worker_pb2.WorkerMessage]
Script = Callable[[Session, Replies], AsyncIterator[worker_pb2.ControlMessage]]


class FakeControl(worker_pb2_grpc.WorkerLinkServicer):
    """Records the hello, then lets a test script decide what to send."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.session = Session()

    async def Connect(self, request_iterator, context):  # type: ignore[no-untyped-def]
        first = await anext(aiter(request_iterator))
        self.session.hello = first.hello
        self.session.hello_seen.set()
        async for message in self.script(self.session, aiter(request_iterator)):
            yield message


@contextlib.asynccontextmanager
async def fake_control(script: Script, port: int = 0) -> AsyncIterator[tuple[FakeControl, int]]:
    servicer = FakeControl(script)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerLinkServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield servicer, bound
    finally:
        await server.stop(grace=None)


@contextlib.asynccontextmanager
async def worker_process(
    model_dir: pathlib.Path, port: int, *extra: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    args = ["--control", f"127.0.0.1:{port}", "--model", str(model_dir), "--device", "cpu"]
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


async def exit_code(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    _, stderr = await asyncio.wait_for(proc.communicate(), PROCESS_TIMEOUT_S)
    assert proc.returncode is not None
    return proc.returncode, stderr.decode(errors="replace")


def welcome(accepted: bool = True, reason: str = "") -> worker_pb2.ControlMessage:
    return worker_pb2.ControlMessage(welcome=worker_pb2.Welcome(accepted=accepted, reason=reason))


def plan_message(plan: StepPlan) -> worker_pb2.ControlMessage:
    return worker_pb2.ControlMessage(plan=codec.plan_to_proto(plan))


def two_step_plans() -> list[StepPlan]:
    slots = SlotAllocator(1024, page_size=4, seed=5)
    prefill = make_plan(
        100, new_seqs=[new_seq(1)], extends=[Extend(1, 0, PROMPT, slots.alloc(1, len(PROMPT)))]
    )
    return [prefill, make_plan(101, decodes=[(1, int(slots.alloc(1, 1)[0]))])]


def run_plans_then(last: worker_pb2.ControlMessage | None) -> Script:
    """Welcome, send each plan and wait for its result, then send `last` (None: end the stream)."""

    async def script(session: Session, replies: Replies):  # type: ignore[no-untyped-def]
        yield welcome()
        for plan in two_step_plans():
            yield plan_message(plan)
            session.results.append((await anext(replies)).result)
        if last is not None:
            yield last

    return script


async def welcome_then_wait(session: Session, replies: Replies):  # type: ignore[no-untyped-def]
    yield welcome()
    await asyncio.sleep(PROCESS_TIMEOUT_S)


def expected_tokens(make_executor) -> list[int]:  # type: ignore[no-untyped-def]
    executor = make_executor(capacity=1024)
    return [int(executor.execute(plan).token_ids[0]) for plan in two_step_plans()]


def tokens(result: worker_pb2.StepResult) -> list[int]:
    return codec.result_from_proto(result).token_ids.tolist()


SHUTDOWN = worker_pb2.ControlMessage(shutdown=worker_pb2.Shutdown(reason="test over"))


async def test_worker_says_hello_runs_plans_and_exits_on_shutdown(model_dir, make_executor) -> None:
    async with (
        fake_control(run_plans_then(SHUTDOWN)) as (control, port),
        worker_process(model_dir, port) as proc,
    ):
        code, stderr = await exit_code(proc)
    assert code == 0, stderr
    hello = control.session.hello
    assert hello is not None
    assert (hello.protocol_version, hello.worker_id, hello.page_size) == (2, "test-worker", 1)
    assert hello.model_fingerprint == model_fingerprint(model_dir)
    assert (hello.kv_capacity_tokens, hello.max_context, hello.vocab_size) == (1024, 2048, 1024)
    assert (hello.dtype, hello.device, list(hello.eos_token_ids)) == ("float32", "cpu", [0])
    results = control.session.results
    assert [r.step_id for r in results] == [100, 101]
    assert [tokens(r) for r in results] == [[t] for t in expected_tokens(make_executor)]
    assert (results[1].kv.live_seqs, results[1].kv.seq_slots) == (1, len(PROMPT) + 1)


async def test_worker_keeps_dialing_until_the_control_plane_is_up(model_dir) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with worker_process(model_dir, port, "--connect-timeout", "30") as proc:
        await asyncio.sleep(1.5)
        async with fake_control(run_plans_then(SHUTDOWN), port=port) as (control, _):
            code, stderr = await exit_code(proc)
    assert code == 0, stderr
    assert len(control.session.results) == 2


async def test_refused_worker_exits_nonzero_with_the_reason(model_dir) -> None:
    async def refuse(session, replies):  # type: ignore[no-untyped-def]
        yield welcome(accepted=False, reason="fingerprint mismatch")

    async with fake_control(refuse) as (_, port), worker_process(model_dir, port) as proc:
        code, stderr = await exit_code(proc)
    assert code == 2
    assert "fingerprint mismatch" in stderr


async def test_broken_stream_exits_nonzero(model_dir) -> None:
    async with fake_control(run_plans_then(None)) as (control, port), worker_process(model_dir, port) as proc:
        code, stderr = await exit_code(proc)
    assert code == 1
    assert "stream_broken" in stderr
    assert len(control.session.results) == 2


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_signal_exits_cleanly(model_dir, sig: signal.Signals) -> None:
    async with fake_control(welcome_then_wait) as (control, port), worker_process(model_dir, port) as proc:
        await asyncio.wait_for(control.session.hello_seen.wait(), PROCESS_TIMEOUT_S)
        await asyncio.sleep(0.3)  # let it read the Welcome
        proc.send_signal(sig)
        code, stderr = await exit_code(proc)
    assert code == 0, stderr


async def test_unreachable_control_plane_gives_up_after_the_timeout(model_dir) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with worker_process(model_dir, port, "--connect-timeout", "1") as proc:
        code, stderr = await exit_code(proc)
    assert code == 3
    assert "connect_failed" in stderr


def test_missing_model_exits_with_a_message(tmp_path: pathlib.Path) -> None:
    import subprocess

    args = [sys.executable, "-m", "data_plane.worker", "--model", str(tmp_path), "--device", "cpu"]
    proc = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    assert proc.returncode == 4
    assert "config.json" in proc.stderr


async def test_an_empty_control_message_ends_the_session_cleanly(model_dir: pathlib.Path) -> None:
    """A ControlMessage with nothing in it once raised out of the serve loop with a traceback."""
    empty = worker_pb2.ControlMessage()
    async with (
        fake_control(run_plans_then(empty)) as (control, port),
        worker_process(model_dir, port) as proc,
    ):
        code, stderr = await exit_code(proc)
    assert code == 1
    assert "Traceback" not in stderr and "cannot read" in stderr
    assert len(control.session.results) == 2
