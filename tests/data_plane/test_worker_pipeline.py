"""The worker's pipelined session: plan N+1 is read and decoded while N executes, results come back
in order, each saying how long the worker waited for its plan; the plan queue is bounded."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from data_plane.session import MAX_QUEUED_PLANS, _Inbox, _read_plans
from protos import worker_codec
from protos.stepwise.v1 import worker_pb2
from protos.worker import Move, Shutdown, StepPlan
from tests.data_plane.factories import Extend, SlotAllocator, make_plan, new_seq
from tests.data_plane.fake_control import (
    PROMPT,
    SHUTDOWN,
    Session,
    exit_code,
    fake_control,
    plan_message,
    welcome,
    worker_process,
)

STEP_S = 0.3  # every sim step sleeps this long
SIM = ("--backend", "sim", "--sim-cost", f"{STEP_S},0,0")


def three_plans() -> list[StepPlan]:
    slots = SlotAllocator(1024, page_size=1, seed=3)
    plans = [
        make_plan(100, new_seqs=[new_seq(1)], extends=[Extend(1, 0, PROMPT, slots.alloc(1, len(PROMPT)))])
    ]
    plans += [make_plan(101 + i, decodes=[(1, int(slots.alloc(1, 1)[0]))]) for i in range(2)]
    return plans


async def send_back_to_back(session: Session):  # type: ignore[no-untyped-def]
    """Two plans in flight, as an overlapping control plane keeps them: the next plan is sent as soon
    as a result comes back, so one is always queued behind the one executing."""
    yield welcome()
    plans = three_plans()
    yield plan_message(plans[0])
    yield plan_message(plans[1])
    await session.next_result()
    yield plan_message(plans[2])
    for _ in range(2):
        await session.next_result()
    yield SHUTDOWN


async def send_after_a_pause(session: Session):  # type: ignore[no-untyped-def]
    """One plan at a time, the next only STEP_S after the last result: the worker sits idle."""
    yield welcome()
    for plan in three_plans():
        yield plan_message(plan)
        await session.next_result()
        await asyncio.sleep(STEP_S)
    yield SHUTDOWN


async def test_the_next_plan_is_ready_when_a_step_ends(model_dir: pathlib.Path) -> None:
    async with (
        fake_control(send_back_to_back) as control,
        worker_process(model_dir, control.port, *SIM) as proc,
    ):
        code, stderr = await exit_code(proc)
    assert code == 0, stderr
    results = control.sessions[0].results
    assert [r.step_id for r in results] == [100, 101, 102]
    assert all(len(worker_codec.result_from_proto(r).token_ids) == 1 for r in results)
    assert results[0].wait_s == 0.0  # the first plan of a session has no step before it
    # Plans 101 and 102 were read and decoded while the step before them slept.
    assert [r.wait_s for r in results[1:]] == [0.0, 0.0]


async def test_wait_s_is_the_idle_gap_before_a_plan(model_dir: pathlib.Path) -> None:
    async with (
        fake_control(send_after_a_pause) as control,
        worker_process(model_dir, control.port, *SIM) as proc,
    ):
        code, stderr = await exit_code(proc)
    assert code == 0, stderr
    waits = [r.wait_s for r in control.sessions[0].results]
    assert waits[0] == 0.0
    assert all(STEP_S * 0.8 < w < STEP_S * 5 for w in waits[1:]), waits


class _EndlessPlans:
    """A Connect call that always has another plan to read; counts the reads."""

    def __init__(self) -> None:
        self.reads = 0

    async def read(self) -> worker_pb2.ControlMessage:
        self.reads += 1
        return worker_codec.plan_to_proto(make_plan(self.reads))


async def test_the_reader_stops_reading_when_the_queue_is_full() -> None:
    call = _EndlessPlans()
    inbox: _Inbox = asyncio.Queue(maxsize=MAX_QUEUED_PLANS)
    reader = asyncio.create_task(_read_plans(call, worker_codec.PlanDecoder(), inbox))  # type: ignore[arg-type]
    try:
        for _ in range(50):
            await asyncio.sleep(0)
        # Eight queued and one more read, waiting for room: the stream is not read any further.
        assert (inbox.qsize(), call.reads) == (MAX_QUEUED_PLANS, MAX_QUEUED_PLANS + 1)
        first = await inbox.get()
        assert not isinstance(first, Shutdown | Move | Exception) and first.plan.step_id == 1
        for _ in range(50):
            await asyncio.sleep(0)
        assert call.reads == MAX_QUEUED_PLANS + 2
    finally:
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
