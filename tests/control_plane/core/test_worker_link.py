"""The worker link's reader (control_plane/core/worker_link.py): a Drain, or a report of a transfer
received, between results or while no plan is in flight, reaches the engine at once; the session ends
with one Shutdown or one Move."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from control_plane.core.handover import WorkerGone
from control_plane.core.worker_checks import WorkerFault
from control_plane.core.worker_link import StreamChannel
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.worker import DecodeWork, StepKind, StepPlan, TransferOutcome

pytestmark = pytest.mark.timeout(10)


class _Stream:
    """A Connect stream's server side whose worker messages arrive when the test puts them."""

    def __init__(self) -> None:
        self.written: list[wk_pb.ControlMessage] = []
        self.incoming: asyncio.Queue[object] = asyncio.Queue()

    async def write(self, message: wk_pb.ControlMessage) -> None:
        self.written.append(message)

    async def read(self) -> object:
        return await self.incoming.get()


def _plan(step_id: int) -> StepPlan:
    decodes = DecodeWork(np.array([1], dtype=np.int64), np.array([10 + step_id], dtype=np.int64))
    return StepPlan(step_id=step_id, kind=StepKind.DECODE, decodes=decodes)


def _result(step_id: int) -> wk_pb.WorkerMessage:
    tokens = np.asarray([40 + step_id], "<i4").tobytes()
    return wk_pb.WorkerMessage(result=wk_pb.StepResult(step_id=step_id, token_ids=tokens))


def _drain(reason: str) -> wk_pb.WorkerMessage:
    return wk_pb.WorkerMessage(drain=wk_pb.Drain(reason=reason))


async def test_a_drain_between_results_is_told_at_once_and_the_results_still_arrive() -> None:
    stream, drains = _Stream(), []
    link = StreamChannel(stream, on_drain=drains.append)  # type: ignore[arg-type]
    await link.send(_plan(1))
    await link.send(_plan(2))
    for message in (_result(1), _drain("SIGTERM"), _result(2)):
        stream.incoming.put_nowait(message)
    first = await link.receive()
    second = await link.receive()
    assert (first.step_id, second.step_id) == (1, 2)
    assert second.token_ids.tolist() == [42]
    assert drains == ["SIGTERM"]


async def test_a_drain_while_no_plan_is_in_flight_is_told_too() -> None:
    stream, drains = _Stream(), []
    told = asyncio.Event()
    link = StreamChannel(stream, on_drain=lambda reason: (drains.append(reason), told.set()))  # type: ignore[arg-type]
    link.start()
    stream.incoming.put_nowait(_drain("scaled down"))
    await asyncio.wait_for(told.wait(), 5)
    assert drains == ["scaled down"] and link.in_flight == 0
    await link.close("done")


def _received(transfer_id: str, nbytes: int, error: str = "") -> wk_pb.WorkerMessage:
    return wk_pb.WorkerMessage(
        received=wk_pb.TransferOutcome(transfer_id=transfer_id, bytes=nbytes, error=error)
    )


async def test_a_transfer_received_is_told_at_once_between_results() -> None:
    stream, told = _Stream(), []
    link = StreamChannel(stream, on_received=told.append)  # type: ignore[arg-type]
    await link.send(_plan(1))
    for message in (_received("a/1", 96), _result(1), _received("a/2", 32)):
        stream.incoming.put_nowait(message)
    assert (await link.receive()).step_id == 1
    await asyncio.sleep(0.01)
    assert told == [TransferOutcome("a/1", "", 96), TransferOutcome("a/2", "", 32)]


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (_received("", 96), "without a transfer_id"),
        (_received("a/1", 96, error="UNAVAILABLE"), "carries an error"),
        (_received("a/1", -1), "bytes -1 is negative"),
    ],
    ids=["no-id", "an-error", "negative-bytes"],
)
async def test_a_malformed_received_report_is_a_fault(message: wk_pb.WorkerMessage, error: str) -> None:
    stream, told = _Stream(), []
    link = StreamChannel(stream, on_received=told.append)  # type: ignore[arg-type]
    await link.send(_plan(1))
    stream.incoming.put_nowait(message)
    with pytest.raises(WorkerFault, match=error):
        await link.receive()
    assert told == []


async def test_a_broken_stream_stays_broken_for_every_later_receive() -> None:
    stream = _Stream()
    link = StreamChannel(stream)  # type: ignore[arg-type]
    await link.send(_plan(1))
    await link.send(_plan(2))
    stream.incoming.put_nowait(None)  # EOF
    for _ in range(2):
        with pytest.raises(WorkerGone, match="stream closed"):
            await link.receive()


async def test_a_result_nobody_asked_for_is_a_fault() -> None:
    stream = _Stream()
    link = StreamChannel(stream)  # type: ignore[arg-type]
    link.start()
    stream.incoming.put_nowait(_result(1))  # before any plan was sent
    await asyncio.sleep(0.01)
    await link.send(_plan(1))
    with pytest.raises(WorkerFault, match="a result for step 1, but no plan is in flight"):
        await link.receive()


@pytest.mark.parametrize("first", ["close", "move"])
async def test_the_session_ends_with_one_message(first: str) -> None:
    stream = _Stream()
    link = StreamChannel(stream)  # type: ignore[arg-type]
    link.start()
    if first == "move":
        await link.move("rebalancing")
    await link.close("control plane is shutting down")
    await link.move("again")
    assert [m.WhichOneof("msg") for m in stream.written] == ["move" if first == "move" else "shutdown"]
    if first == "move":
        assert stream.written[0].move.reason == "rebalancing"
