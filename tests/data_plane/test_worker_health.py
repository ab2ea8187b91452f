"""The worker's health service and its drain, in this process: "" SERVING once loaded, readiness
("stepwise.v1.WorkerLink") SERVING only while attached and not draining; a draining worker tells
its control plane, keeps running plans, and stops when its session ends."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from data_plane.health import READY_SERVICE, WorkerHealth
from data_plane.link import Link
from protos.worker import Census
from tests.data_plane.fake_control import (
    MOVE,
    SHUTDOWN,
    WAIT_S,
    Session,
    fake_control,
    hold,
    plan_message,
    served,
    serving,
    two_step_plans,
    welcome,
    welcome_then,
)
from tests.polling import until

pytestmark = pytest.mark.timeout(60)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@contextlib.asynccontextmanager
async def health_server() -> AsyncIterator[WorkerHealth]:
    health = WorkerHealth()
    await health.start("127.0.0.1", 0)
    try:
        yield health
    finally:
        await health.stop()


async def statuses(health: WorkerHealth) -> tuple[int, int]:
    """(liveness "", readiness) as a probe sees them."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{health.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answers = [
            await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            for name in ("", READY_SERVICE)
        ]
    return answers[0].status, answers[1].status


async def test_readiness_follows_the_welcome_and_the_drain(model_dir: pathlib.Path) -> None:
    go = asyncio.Event()

    async def welcome_when_told_then_drain(session: Session):  # type: ignore[no-untyped-def]
        await go.wait()
        yield welcome()
        await session.drained.wait()
        yield plan_message(two_step_plans()[0])  # a draining worker still runs plans
        await session.next_result()
        yield SHUTDOWN

    async with health_server() as health:
        assert await statuses(health) == (NOT_SERVING, NOT_SERVING)  # the model is not loaded yet
        await health.set_loaded()
        link = Link(health)
        async with (
            fake_control(welcome_when_told_then_drain) as plane,
            serving(model_dir, plane.address, link=link) as worker,
        ):
            session = await plane.session(0)
            assert await statuses(health) == (SERVING, NOT_SERVING)  # hello sent, not welcomed
            go.set()
            await until(lambda: link.attached, WAIT_S, "the link attached")
            assert await statuses(health) == (SERVING, SERVING)
            await link.drain("SIGTERM")
            assert await statuses(health) == (SERVING, NOT_SERVING)
            assert await served(worker) == 0
        assert session.drains == ["SIGTERM"]
        assert [r.step_id for r in session.results] == [100]
        assert await statuses(health) == (SERVING, NOT_SERVING)


async def test_readiness_drops_when_the_control_plane_goes_away(model_dir: pathlib.Path) -> None:
    async with health_server() as health:
        link = Link(health)
        async with fake_control(hold()) as plane, serving(model_dir, plane.address, link=link) as worker:
            await until(lambda: link.attached, WAIT_S, "the link attached")
            assert (await statuses(health))[1] == SERVING
            await plane.stop()
            # The control plane is gone; the worker searches on, unready.
            await until(lambda: not link.attached, WAIT_S, "the link detached")
            assert (await statuses(health))[1] == NOT_SERVING
            assert not worker.done()


async def test_a_move_while_draining_ends_the_worker(model_dir: pathlib.Path) -> None:
    async def move_once_drained(session: Session):  # type: ignore[no-untyped-def]
        yield welcome()
        await session.drained.wait()
        yield MOVE
        await asyncio.wait_for(session.half_closed.wait(), 10)

    link = Link()
    async with (
        fake_control(move_once_drained, census=Census(workers=0)) as a,
        fake_control(welcome_then(SHUTDOWN), census=Census(workers=5)) as b,
        serving(model_dir, f"{a.address},{b.address}", link=link) as worker,
    ):
        await until(lambda: link.attached, WAIT_S, "the link attached")
        await link.drain("SIGTERM")
        assert await served(worker) == 0
    assert (len(a.sessions), len(b.sessions)) == (1, 0)  # no new search


async def test_a_lost_stream_while_draining_ends_the_worker(model_dir: pathlib.Path) -> None:
    async def end_once_drained(session: Session):  # type: ignore[no-untyped-def]
        yield welcome()
        await session.drained.wait()

    link = Link()
    async with (
        fake_control(end_once_drained) as plane,
        serving(model_dir, plane.address, link=link) as worker,
    ):
        await until(lambda: link.attached, WAIT_S, "the link attached")
        await link.drain("SIGTERM")
        assert await served(worker) == 0
    assert len(plane.sessions) == 1


async def test_a_taken_health_port_is_an_error_naming_the_flag() -> None:
    async with health_server() as taken:
        with pytest.raises(OSError, match="--health-port"):
            await WorkerHealth().start("127.0.0.1", taken.port)
