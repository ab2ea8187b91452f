"""The worker as a real process against a fake control plane (grpc.aio WorkerLink on loopback)."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys

import pytest

from data_plane.models.loader import model_fingerprint
from protos.stepwise.v1 import worker_pb2
from tests.data_plane.fake_control import (
    PROMPT,
    REPO_ROOT,
    SHUTDOWN,
    exit_code,
    fake_control,
    free_port,
    read_log_until,
    run_plans_then,
    tokens,
    two_step_plans,
    welcome,
    worker_process,
)

PROCESS_TIMEOUT_S = 60


def expected_tokens(make_executor) -> list[int]:  # type: ignore[no-untyped-def]
    executor = make_executor(capacity=1024)
    return [int(executor.execute(plan).token_ids[0]) for plan in two_step_plans()]


async def test_worker_says_hello_runs_plans_and_exits_on_shutdown(model_dir, make_executor) -> None:
    async with (
        fake_control(run_plans_then(SHUTDOWN)) as control,
        worker_process(model_dir, control.port) as proc,
    ):
        code, stderr = await exit_code(proc)
    assert code == 0, stderr
    [session] = control.sessions
    hello = session.hello
    assert hello is not None
    assert (hello.protocol_version, hello.worker_id, hello.page_size) == (2, "test-worker", 1)
    assert hello.model_fingerprint == model_fingerprint(model_dir)
    assert (hello.kv_capacity_tokens, hello.max_context, hello.vocab_size) == (1024, 2048, 1024)
    assert (hello.dtype, hello.device, list(hello.eos_token_ids)) == ("float32", "cpu", [0])
    results = session.results
    assert [r.step_id for r in results] == [100, 101]
    assert [tokens(r) for r in results] == [[t] for t in expected_tokens(make_executor)]
    assert (results[1].kv.live_seqs, results[1].kv.seq_slots) == (1, len(PROMPT) + 1)


async def test_worker_keeps_dialing_until_the_control_plane_is_up(model_dir) -> None:
    port = free_port()
    async with worker_process(model_dir, port, "--connect-timeout", "30") as proc:
        for _ in range(3):  # three searches found no control plane: it is up only after them
            await read_log_until(proc, '"redial"')
        async with fake_control(run_plans_then(SHUTDOWN), port=port) as control:
            code, stderr = await exit_code(proc)
    assert code == 0, stderr
    assert len(control.sessions[0].results) == 2


async def test_refused_worker_exits_2_with_the_reason(model_dir) -> None:
    async def refuse(session):  # type: ignore[no-untyped-def]
        yield welcome(accepted=False, reason="fingerprint mismatch")

    async with fake_control(refuse) as control, worker_process(model_dir, control.port) as proc:
        code, stderr = await exit_code(proc)
    assert code == 2
    assert "fingerprint mismatch" in stderr
    assert len(control.sessions) == 1


async def test_refused_everywhere_exits_2_with_one_line_for_each_control_plane(model_dir) -> None:
    def refusing(reason: str):  # type: ignore[no-untyped-def]
        async def refuse(session):  # type: ignore[no-untyped-def]
            yield welcome(accepted=False, reason=reason)

        return refuse

    async with (
        fake_control(refusing("page size 16 here")) as a,
        fake_control(refusing("another model here")) as b,
        worker_process(model_dir, f"{a.address},{b.address}") as proc,
    ):
        code, stderr = await exit_code(proc)
    assert code == 2, stderr
    lines = [json.loads(line) for line in stderr.splitlines() if '"refused_everywhere"' in line]
    assert sorted((e["control_plane"], e["reason"]) for e in lines) == sorted(
        [(a.address, "page size 16 here"), (b.address, "another model here")]
    )
    assert (len(a.sessions), len(b.sessions)) == (1, 1)


async def test_a_broken_stream_is_a_lost_control_plane_and_the_worker_dials_again(model_dir) -> None:
    async with (
        fake_control(run_plans_then(None), run_plans_then(SHUTDOWN)) as control,
        worker_process(model_dir, control.port) as proc,
    ):
        code, stderr = await exit_code(proc)
    assert code == 0, stderr
    assert stderr.count("control_plane_lost") == 1
    first, second = control.sessions
    # The second session starts empty: handle 1 is new to it again, and decodes the same token.
    assert [tokens(r) for r in first.results] == [tokens(r) for r in second.results]
    assert not any(r.error for r in first.results + second.results)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_while_not_attached_exits_at_once(model_dir, sig: signal.Signals) -> None:
    async with worker_process(model_dir, free_port(), "--connect-timeout", "60") as proc:
        before = await read_log_until(proc, '"redial"')  # loaded, and searching
        proc.send_signal(sig)
        code, stderr = await exit_code(proc, timeout_s=5.0)
    assert code == 0, before + stderr
    assert "signalled" in stderr


async def test_unreachable_control_plane_gives_up_after_the_timeout(model_dir) -> None:
    async with worker_process(model_dir, free_port(), "--connect-timeout", "1") as proc:
        code, stderr = await exit_code(proc)
    assert code == 3
    assert "connect_failed" in stderr


def test_missing_model_exits_with_a_message(tmp_path: pathlib.Path) -> None:
    args = [sys.executable, "-m", "data_plane.worker", "--model", str(tmp_path), "--device", "cpu"]
    proc = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    assert proc.returncode == 4
    assert "config.json" in proc.stderr


async def test_an_empty_control_message_ends_the_session_cleanly(model_dir: pathlib.Path) -> None:
    """A ControlMessage with nothing in it once raised out of the serve loop with a traceback; now
    it ends the session as a broken stream does, and the worker dials again."""
    empty = worker_pb2.ControlMessage()
    async with (
        fake_control(run_plans_then(empty), run_plans_then(SHUTDOWN)) as control,
        worker_process(model_dir, control.port) as proc,
    ):
        code, stderr = await exit_code(proc)
    assert code == 0, stderr
    assert "Traceback" not in stderr and "cannot read" in stderr
    assert [len(s.results) for s in control.sessions] == [2, 2]
