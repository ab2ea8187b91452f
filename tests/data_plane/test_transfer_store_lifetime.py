"""What a worker's transfer store holds is released when nobody can claim it any more: copies of a
session that ended (its control plane forgot them with it), and any copy held past its deadline
(docs/migration.md#what-a-destination-holds).

The reproduction (issue 37): a decode worker with a 64 KiB buffer, stopped during copies, dropped,
resumed: the copies that landed for its old session stayed held for good (30,720 bytes), and a
40 KiB hand-off that fit before was refused from then on.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator

import pytest
import torch

from data_plane.kv_pool import HostCopy
from data_plane.kv_transfer import TransferHeader, TransferRefused, TransferStore
from protos import worker_codec
from protos.stepwise.v1 import worker_pb2
from protos.worker import Dropped
from tests.data_plane.fake_control import (
    SHUTDOWN,
    Session,
    fake_control,
    plan_message,
    served,
    serving,
    two_step_plans,
    welcome,
)

pytestmark = pytest.mark.timeout(60)

KiB = 1024


def _copy(kib: int) -> HostCopy:
    """K and V of `kib` KiB together (float16, 64 values a token)."""
    k = torch.zeros((1, kib * KiB // 256, 1, 64), dtype=torch.float16)
    return HostCopy(k, k.clone())


def _land(store: TransferStore, transfer_id: str, kib: int) -> None:
    """A transfer arrives whole: its header reserves room, then its bytes complete it."""
    _arrive(store, transfer_id, kib)
    store.complete(transfer_id, _copy(kib))


def _arrive(store: TransferStore, transfer_id: str, kib: int) -> None:
    copy = _copy(kib)
    store.reserve(TransferHeader.of(transfer_id, copy.k, copy.v))


async def test_copies_of_a_session_that_ended_are_released_when_the_next_one_starts(
    model_dir: pathlib.Path,
) -> None:
    """Session 1 is dropped holding a 10 KiB copy its control plane never claimed and with a 20 KiB
    one still arriving, which lands after session 2 began. Neither can ever be claimed: session 2's
    control plane knows nothing of them. A 40 KiB hand-off in session 2 must fit the 64 KiB buffer."""
    store = TransferStore(64 * KiB)
    running, drop, checked = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def dropped_session(session: Session) -> AsyncIterator[worker_pb2.ControlMessage]:
        yield welcome(transfer_reports=True)
        yield plan_message(two_step_plans()[0])
        await session.next_result()
        running.set()
        await drop.wait()
        yield worker_codec.control_to_proto(Dropped("no result for step 101 within 5.0 s"))

    async def next_session(session: Session) -> AsyncIterator[worker_pb2.ControlMessage]:
        yield welcome(transfer_reports=True)
        await checked.wait()
        yield SHUTDOWN

    async with (
        fake_control(dropped_session, next_session) as control,
        serving(model_dir, control.address, received=store) as worker,
    ):
        await asyncio.wait_for(running.wait(), 30)
        _land(store, "p0/held", 10)
        _arrive(store, "p0/late", 20)
        assert store.used_bytes == 30 * KiB
        drop.set()
        await control.session(1)  # the worker said hello again: session 2 has begun
        store.complete("p0/late", _copy(20))
        held = store.used_bytes
        try:
            _land(store, "p0/handoff", 40)
        except TransferRefused as exc:
            pytest.fail(f"{held} bytes of session 1 still held; the 40 KiB hand-off was refused: {exc}")
        finally:
            checked.set()
        assert await served(worker) == 0
    assert held == 0
    assert "p0/handoff" in store and "p0/held" not in store and "p0/late" not in store


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_copy_unclaimed_past_its_deadline_is_released() -> None:
    clock = _Clock()
    store = TransferStore(64 * KiB, hold_s=30.0, clock=clock)
    _land(store, "p0/a", 10)
    clock.now += 20.0
    _land(store, "p0/b", 20)
    clock.now += 9.9
    store.expire()
    assert store.used_bytes == 30 * KiB  # neither is due
    clock.now += 0.2
    store.expire()
    assert store.used_bytes == 20 * KiB and "p0/a" not in store and "p0/b" in store
    with pytest.raises(KeyError, match="p0/a"):
        store.take("p0/a")
    # A header that needs the room of a copy past its deadline gets it without waiting for a sweep.
    clock.now += 20.0
    _land(store, "p0/c", 60)
    assert "p0/b" not in store and store.used_bytes == 60 * KiB


def test_a_copy_claimed_within_its_deadline_is_the_steps_and_one_arriving_has_no_hold_deadline() -> None:
    """The hold deadline starts when a copy is complete: a slow arrival is its sender's deadline's
    business (the call is cancelled when it passes, and the room given back)."""
    clock = _Clock()
    store = TransferStore(64 * KiB, hold_s=30.0, clock=clock)
    _land(store, "p0/a", 10)
    _arrive(store, "p0/b", 10)
    clock.now += 29.0
    assert store.take("p0/a").k.shape[1] == 40
    clock.now += 100.0
    store.expire()
    store.complete("p0/b", _copy(10))
    clock.now += 29.0
    store.expire()
    assert "p0/b" in store


async def test_a_receiver_releases_an_unclaimed_copy_at_its_deadline_unasked() -> None:
    """Over gRPC: nothing else happens on the receiver, and the copy is released all the same."""
    from data_plane.kv_transfer_grpc import GrpcKvTransport

    store = TransferStore(64 * KiB, hold_s=0.3)
    receiver = GrpcKvTransport("127.0.0.1", 0, 0, received=store)
    sender = GrpcKvTransport("127.0.0.1", 0, 0)
    try:
        address = await receiver.start()
        copy = _copy(10)
        await sender.send(address, "p0/a", copy.k, copy.v)
        assert store.used_bytes == 10 * KiB
        async with asyncio.timeout(10):
            while store.used_bytes:
                await asyncio.sleep(0.05)
    finally:
        await sender.stop()
        await receiver.stop()
    assert "p0/a" not in store
