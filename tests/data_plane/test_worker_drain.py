"""SIGTERM drains a worker process: it sends Drain, turns unready, runs plans until the control plane
sends Shutdown, and exits 0; without a Shutdown it exits 0 after --drain-timeout plus the grace; a
second signal ends it at once."""

from __future__ import annotations

import asyncio
import pathlib
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from data_plane.health import READY_SERVICE
from data_plane.worker import DRAIN_GRACE_S
from tests.data_plane.fake_control import (
    SHUTDOWN,
    WAIT_S,
    Session,
    exit_code,
    fake_control,
    free_port,
    hold,
    plan_message,
    two_step_plans,
    welcome,
    worker_process,
)
from tests.polling import until

SIM = ("--backend", "sim")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def readiness(port: int) -> int | None:
    """The worker's readiness status; None while nothing answers on `port`."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=READY_SERVICE), timeout=1
            )
        except grpc.aio.AioRpcError:
            return None
    return reply.status


async def until_ready(port: int, want: int) -> None:
    async def ready() -> bool:
        return await readiness(port) == want

    await until(ready, WAIT_S, f"health {want} on port {port}", every_s=0.05)


@pytest.mark.timeout(90)
async def test_sigterm_drains_runs_plans_and_exits_0_on_shutdown(model_dir: pathlib.Path) -> None:
    async def drain_then_shutdown(session: Session):  # type: ignore[no-untyped-def]
        yield welcome()
        await session.drained.wait()
        for plan in two_step_plans():  # its last requests finish during the drain
            yield plan_message(plan)
            await session.next_result()
        yield SHUTDOWN

    health_port = free_port()
    async with (
        fake_control(drain_then_shutdown) as plane,
        worker_process(model_dir, plane.port, *SIM, "--health-port", str(health_port)) as proc,
    ):
        await until_ready(health_port, SERVING)
        proc.send_signal(signal.SIGTERM)
        session = plane.sessions[0]
        await asyncio.wait_for(session.drained.wait(), WAIT_S)
        assert await readiness(health_port) == NOT_SERVING
        code, stderr = await exit_code(proc)
    assert code == 0, stderr
    assert session.drains == ["SIGTERM"]
    assert [r.step_id for r in session.results] == [100, 101]
    assert not any(r.error for r in session.results)


@pytest.mark.timeout(90)
async def test_a_second_signal_ends_a_drain_at_once(model_dir: pathlib.Path) -> None:
    health_port = free_port()
    async with (
        fake_control(hold()) as plane,
        worker_process(model_dir, plane.port, *SIM, "--health-port", str(health_port)) as proc,
    ):
        await until_ready(health_port, SERVING)
        session = plane.sessions[0]
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(session.drained.wait(), WAIT_S)
        proc.send_signal(signal.SIGINT)
        code, stderr = await exit_code(proc, timeout_s=5.0)
    assert code == 0, stderr
    assert "signalled_again" in stderr


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_without_shutdown_the_drain_ends_after_its_timeout_and_grace(model_dir: pathlib.Path) -> None:
    drain_timeout_s, health_port = 0.5, free_port()
    flags = ("--drain-timeout", str(drain_timeout_s), "--health-port", str(health_port))
    async with fake_control(hold(60.0)) as plane, worker_process(model_dir, plane.port, *SIM, *flags) as proc:
        await until_ready(health_port, SERVING)
        session = plane.sessions[0]
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(session.drained.wait(), WAIT_S)
        signalled = time.monotonic()
        code, stderr = await exit_code(proc)
        waited = time.monotonic() - signalled
    assert code == 0, stderr
    assert "drain_timed_out" in stderr
    assert drain_timeout_s + DRAIN_GRACE_S - 0.5 <= waited < drain_timeout_s + DRAIN_GRACE_S + 5
