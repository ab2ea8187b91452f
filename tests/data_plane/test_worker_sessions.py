"""A worker (the sim backend, in this process) over several sessions with fake control planes: it
attaches to the least-loaded one, dials again when one goes away, leaves on Move, retries a
retryable refusal, and starts every session with nothing from the last."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time
from collections.abc import AsyncIterator

import pytest
import torch

from data_plane.kv_pool import HostCopy
from data_plane.kv_transfer import TransferHeader, TransferStore
from protos.stepwise.v1 import worker_pb2
from protos.worker import Census
from tests.data_plane.fake_control import (
    MOVE,
    SHUTDOWN,
    FakeControl,
    Session,
    fake_control,
    free_port,
    hold,
    plan_message,
    run_plans_then,
    served,
    serving,
    tokens,
    two_step_plans,
    welcome,
    welcome_then,
)

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def control_planes(
    *planes: contextlib.AbstractAsyncContextManager[FakeControl],
) -> AsyncIterator[list[FakeControl]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(plane) for plane in planes]


def control_of(*planes: FakeControl) -> str:
    return ",".join(p.address for p in planes)


async def test_the_worker_attaches_to_the_control_plane_with_the_fewest_workers(
    model_dir: pathlib.Path,
) -> None:
    async with (
        control_planes(
            fake_control(census=Census(workers=2)),
            fake_control(run_plans_then(SHUTDOWN), census=Census(workers=0)),
            fake_control(census=Census(workers=1)),
        ) as planes,
        serving(model_dir, control_of(*planes)) as worker,
    ):
        assert await served(worker) == 0
    assert [len(p.sessions) for p in planes] == [0, 1, 0]
    assert [r.step_id for r in planes[1].sessions[0].results] == [100, 101]


async def test_after_a_closed_stream_the_worker_attaches_again_and_starts_clean(
    model_dir: pathlib.Path,
) -> None:
    """The second session reintroduces handle 1 and diffs its decode set against nothing: both work
    only if the executor and the plan decoder start the session empty."""
    async with (
        fake_control(run_plans_then(None), run_plans_then(SHUTDOWN)) as plane,
        serving(model_dir, plane.address) as worker,
    ):
        assert await served(worker) == 0
    first, second = plane.sessions
    assert not any(r.error for r in first.results + second.results)
    assert [tokens(r) for r in second.results] == [tokens(r) for r in first.results]
    assert second.results[-1].kv.live_seqs == 1


async def test_a_restarted_control_plane_is_found_again_after_the_connect_timeout(
    model_dir: pathlib.Path,
) -> None:
    """--connect-timeout bounds the first search only: once attached, the worker looks forever."""
    port = free_port()
    async with serving(model_dir, f"127.0.0.1:{port}", connect_timeout_s=0.5) as worker:
        async with fake_control(hold(), port=port) as plane:
            await plane.session(0)
        await asyncio.sleep(1.5)  # gone for longer than --connect-timeout
        assert not worker.done()
        async with fake_control(run_plans_then(SHUTDOWN), port=port) as plane:
            assert await served(worker) == 0
    assert len(plane.sessions[0].results) == 2


async def test_move_finishes_the_session_and_attaches_elsewhere(model_dir: pathlib.Path) -> None:
    async def plan_then_move(session: Session):  # type: ignore[no-untyped-def]
        yield welcome()
        yield plan_message(two_step_plans()[0])
        yield MOVE  # sent before the result came back: the worker still answers the plan
        await asyncio.wait_for(session.half_closed.wait(), 10)

    async with (
        control_planes(
            fake_control(plan_then_move, census=Census(workers=0)),
            fake_control(run_plans_then(SHUTDOWN), census=Census(workers=3)),
        ) as (a, b),
        serving(model_dir, control_of(a, b)) as worker,
    ):
        assert await served(worker) == 0
        [left] = a.sessions
        assert [r.step_id for r in left.results] == [100]
        assert left.half_closed.is_set()  # done_writing, not a cancelled call
    # A still had the fewest workers, but it asked the worker to go.
    assert len(a.sessions) == 1 and len(b.sessions) == 1
    assert [r.step_id for r in b.sessions[0].results] == [100, 101]


async def test_a_moved_worker_comes_back_when_no_other_control_plane_fits(model_dir: pathlib.Path) -> None:
    async with (
        control_planes(
            fake_control(welcome_then(MOVE), run_plans_then(SHUTDOWN)),
            fake_control(census=Census(workers=0, accepting=False)),
        ) as (a, b),
        serving(model_dir, control_of(a, b)) as worker,
    ):
        assert await served(worker) == 0
    assert (len(a.sessions), len(b.sessions)) == (2, 0)


async def test_a_retryable_refusal_is_retried(model_dir: pathlib.Path) -> None:
    async def busy(session: Session):  # type: ignore[no-untyped-def]
        yield welcome(accepted=False, reason="still holds test-worker", retryable=True)

    async with (
        fake_control(busy, busy, run_plans_then(SHUTDOWN)) as plane,
        serving(model_dir, plane.address) as worker,
    ):
        assert await served(worker) == 0
    assert [len(s.results) for s in plane.sessions] == [0, 0, 2]


async def test_a_final_refusal_ends_the_worker_with_2(model_dir: pathlib.Path) -> None:
    async def refuse(session: Session):  # type: ignore[no-untyped-def]
        yield welcome(accepted=False, reason="page size 16 unsupported")

    async with fake_control(refuse) as plane, serving(model_dir, plane.address) as worker:
        assert await served(worker) == 2
    assert len(plane.sessions) == 1


async def _refuse_for_good(session: Session):  # type: ignore[no-untyped-def]
    yield welcome(accepted=False, reason="page_size 1 differs from the control plane's --page-size 16")


async def test_a_final_refusal_sends_the_worker_to_another_control_plane_and_is_remembered(
    model_dir: pathlib.Path,
) -> None:
    """A looks emptiest but refuses for good (its census, like an older control plane's, does not
    say so): the worker attaches to B instead, and after B moves it, it does not try A again."""
    async with (
        control_planes(
            fake_control(_refuse_for_good, census=Census(workers=0)),
            fake_control(welcome_then(MOVE), run_plans_then(SHUTDOWN), census=Census(workers=3)),
        ) as (a, b),
        serving(model_dir, control_of(a, b)) as worker,
    ):
        assert await served(worker) == 0
    assert (len(a.sessions), len(b.sessions)) == (1, 2)
    assert [r.step_id for r in b.sessions[1].results] == [100, 101]


async def test_a_final_refusal_while_another_control_plane_is_down_waits_for_that_one(
    model_dir: pathlib.Path,
) -> None:
    """Refused by A while B does not answer (restarting): the worker waits for B, it does not exit."""
    port = free_port()
    async with (
        fake_control(_refuse_for_good, census=Census(workers=0)) as a,
        serving(model_dir, f"{a.address},127.0.0.1:{port}") as worker,
    ):
        await a.session(0)
        async with fake_control(run_plans_then(SHUTDOWN), port=port) as b:
            assert await served(worker) == 0
    assert len(a.sessions) == 1 and [r.step_id for r in b.sessions[0].results] == [100, 101]


async def test_a_control_plane_whose_census_refuses_the_worker_is_not_dialled(
    model_dir: pathlib.Path,
) -> None:
    refusing = Census(workers=0, hello_judged=True, refusal="page_size 1 differs from --page-size 16")
    async with (
        control_planes(
            fake_control(census=refusing),
            fake_control(run_plans_then(SHUTDOWN), census=Census(workers=3)),
        ) as (a, b),
        serving(model_dir, control_of(a, b)) as worker,
    ):
        assert await served(worker) == 0
    assert len(a.sessions) == 0 and len(b.sessions) == 1
    # The census asked about this very worker: its hello, as Connect would send it.
    asked = a.census_hellos[0]
    assert asked is not None and (asked.worker_id, asked.page_size) == ("test-worker", 1)


async def test_a_final_refusal_from_every_control_plane_ends_the_worker_with_2(
    model_dir: pathlib.Path,
) -> None:
    refusing = Census(workers=5, hello_judged=True, refusal="model differs")
    async with (
        control_planes(fake_control(_refuse_for_good), fake_control(census=refusing)) as (a, b),
        serving(model_dir, control_of(a, b)) as worker,
    ):
        assert await served(worker) == 2
    assert (len(a.sessions), len(b.sessions)) == (1, 0)


async def test_no_control_plane_within_the_connect_timeout_is_exit_3(model_dir: pathlib.Path) -> None:
    started = time.monotonic()
    async with serving(model_dir, f"127.0.0.1:{free_port()}", connect_timeout_s=0.4) as worker:
        assert await served(worker) == 3
    assert 0.4 <= time.monotonic() - started < 3.0


async def test_a_control_plane_that_never_welcomes_is_left_for_another(
    model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("data_plane.session.WELCOME_TIMEOUT_S", 0.3)

    async def silent(session: Session):  # type: ignore[no-untyped-def]
        await asyncio.sleep(30)  # answers the census, never the hello
        yield welcome()

    async with (
        control_planes(
            fake_control(silent, census=Census(workers=0)),
            fake_control(run_plans_then(SHUTDOWN), census=Census(workers=3)),
        ) as (a, b),
        serving(model_dir, control_of(a, b)) as worker,
    ):
        assert await served(worker) == 0
    assert len(a.sessions) >= 1 and [r.step_id for r in b.sessions[0].results] == [100, 101]


@pytest.mark.parametrize("asked", [True, False], ids=["asked", "not-asked"])
async def test_a_worker_reports_each_transfer_it_holds_at_once_when_its_welcome_asks(
    model_dir: pathlib.Path, asked: bool
) -> None:
    """Welcomed with `transfer_reports`, the worker tells its control plane of each transfer its
    store completes, between results, without waiting for a plan; otherwise it sends none (an
    older control plane would take the message for a protocol error). The next result is written
    after any report, so its arrival shows none was sent."""
    store = TransferStore(1 << 20)
    running, completed = asyncio.Event(), asyncio.Event()

    async def script(session: Session) -> AsyncIterator[worker_pb2.ControlMessage]:
        yield welcome(transfer_reports=asked)
        first, second = two_step_plans()
        yield plan_message(first)
        await session.next_result()  # the session runs plans: it listens to the store by now
        running.set()
        await completed.wait()
        yield plan_message(second)
        await session.next_result()
        yield SHUTDOWN

    async with fake_control(script) as control, serving(model_dir, control.address, received=store) as worker:
        await asyncio.wait_for(running.wait(), 30)
        k = torch.zeros((1, 4, 1, 8), dtype=torch.float16)
        header = TransferHeader.of("w0/t", k, k)
        store.reserve(header)
        store.complete("w0/t", HostCopy(k, k))
        completed.set()
        assert await served(worker) == 0
        session = await control.session()
    assert session.received == ([("w0/t", header.total_bytes)] if asked else [])
    assert len(session.results) == 2
