"""A plan's KV moves between two workers' executors (worker.proto: KvSend, KvReceive,
TransferOutcome): two executors over the embedded model and two real gRPC transports on 127.0.0.1.

The sequence moved continues on the destination with exactly the tokens it would have produced on
the source; a send snapshots its slots before the plan's releases; every send ends with an outcome;
a receive of nothing, or a plan that asks for moves on a worker without a transfer link, is refused
with a message naming it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
import torch

from data_plane.executor import Executor
from data_plane.kv_pool import HostCopy
from data_plane.kv_transfer import LoopbackTransfers, TransferAgent, TransferHeader, TransferStore
from data_plane.kv_transfer_grpc import GrpcKvTransport
from data_plane.sim import SimExecutor
from protos import worker_codec
from protos.arrays import WireError
from protos.worker import KvReceive, KvSend, StepPlan, StepResult, TransferOutcome
from tests.data_plane.factories import Driver, Extend, make_plan, new_seq

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


@pytest.fixture
async def linked() -> AsyncIterator[Callable[[Executor], object]]:
    """`address = await link(executor)`: the executor gets a transfer agent over a started transport."""
    transports: list[GrpcKvTransport] = []

    async def link(executor: Executor) -> str:
        transport = GrpcKvTransport("127.0.0.1", 0, 64 * MiB)
        transports.append(transport)
        address = await transport.start()
        executor.transfers = TransferAgent(transport, asyncio.get_running_loop())
        return address

    try:
        yield link
    finally:
        for transport in transports:
            await transport.stop()


async def _outcomes(executor: Executor, step_id: int, count: int = 1) -> list[TransferOutcome]:
    """Run empty plans (the loop free between them) until `count` outcomes came back."""
    got: list[TransferOutcome] = []
    for _ in range(2000):
        result = executor.execute(make_plan(step_id))
        assert result.error == ""
        got += result.transfers
        if len(got) >= count:
            return got
        await asyncio.sleep(0.005)
    raise AssertionError(f"no outcome after 10 s; got {got}")


def _with(plan: StepPlan, **moves: object) -> StepPlan:
    return dataclasses.replace(plan, **moves)  # type: ignore[arg-type]


def _run(executor: Executor, plan: StepPlan) -> StepResult:
    result = executor.execute(plan)
    assert result.error == "", result.error
    return result


async def test_a_moved_sequence_continues_with_the_tokens_it_would_have_made(
    make_driver: Callable[..., Driver], make_executor: Callable[..., Executor], linked
) -> None:
    source = make_driver(seed=1)
    dest = make_executor(seed=2)
    await linked(source.executor)
    dest_address = await linked(dest)
    source.prefill({1: list(range(5, 45))})
    for _ in range(5):
        source.decode([1])
    tokens = list(source.tokens[1])  # KV is written for every one but the last
    sent = source.executor.table.slot_table(1)[: len(tokens) - 1].copy()
    # The plan that sends also decodes on: the snapshot is of the slots before this step writes.
    slot = int(source.slots.alloc(1, 1)[0])
    plan = _with(make_plan(50, decodes=[(1, slot)]), sends=(KvSend("move-1", dest_address, sent),))
    result = _run(source.executor, plan)
    want = [int(result.token_ids[0])]
    [outcome] = await _outcomes(source.executor, 51)
    k = source.executor.pool.k
    per_token = 2 * k[:, 0].numel() * k.element_size()
    assert outcome == TransferOutcome("move-1", "", len(sent) * per_token)

    # The destination writes it into slots of its own and continues from the last token.
    dest_slots = np.arange(1000, 1000 + len(sent), dtype=np.int64)
    extend_slot = np.array([2000], dtype=np.int64)
    plan = make_plan(
        1,
        new_seqs=[new_seq(7, prefix_slots=dest_slots)],
        extends=[Extend(7, len(sent), [tokens[-1]], extend_slot)],
    )
    got = [int(_run(dest, _with(plan, receives=(KvReceive("move-1", dest_slots),))).token_ids[0])]
    assert got == want
    for step in range(4):
        want.append(int(_run(source.executor, make_plan(60 + step, decodes=[(1, 3000 + step)])).token_ids[0]))
        got.append(int(_run(dest, make_plan(2 + step, decodes=[(7, 2001 + step)])).token_ids[0]))
    assert got == want
    assert "move-1" not in dest.transfers.received  # type: ignore[union-attr]


async def test_a_send_snapshots_its_slots_before_the_plan_releases_and_reuses_them(
    make_driver: Callable[..., Driver], make_executor: Callable[..., Executor], linked
) -> None:
    source = make_driver(seed=3)
    dest = make_executor()
    await linked(source.executor)
    address = await linked(dest)
    source.prefill({1: list(range(10, 30))})
    slots = source.executor.table.slot_table(1).copy()
    before = source.executor.pool.copy_out(torch.from_numpy(slots))
    # Release the sequence and write another prompt's KV into the very same slots, in one plan.
    plan = make_plan(
        9, releases=[1], new_seqs=[new_seq(2)], extends=[Extend(2, 0, list(range(40, 60)), slots)]
    )
    _run(source.executor, _with(plan, sends=(KvSend("early", address, slots),)))
    await _outcomes(source.executor, 10)
    assert not source.executor.pool.copy_out(torch.from_numpy(slots)).k.equal(before.k)  # overwritten here
    arrived = dest.transfers.received.take("early")  # type: ignore[union-attr]
    assert arrived.k.equal(before.k) and arrived.v.equal(before.v)


async def test_a_send_to_nobody_ends_with_an_outcome_naming_the_failure(
    make_driver: Callable[..., Driver], linked
) -> None:
    source = make_driver()
    await linked(source.executor)
    source.prefill({1: [5, 6, 7]})
    slots = source.executor.table.slot_table(1).copy()
    _run(source.executor, _with(make_plan(5), sends=(KvSend("lost", "127.0.0.1:1", slots),)))
    [outcome] = await _outcomes(source.executor, 6)
    assert outcome.transfer_id == "lost" and outcome.error.startswith("UNAVAILABLE") and outcome.bytes == 0


async def test_a_receive_of_a_transfer_that_never_came_is_a_plan_error(
    make_executor: Callable[..., Executor], linked
) -> None:
    dest = make_executor()
    await linked(dest)
    result = dest.execute(_with(make_plan(1), receives=(KvReceive("ghost", np.arange(4, dtype=np.int64)),)))
    assert "receives: no transfer 'ghost' has arrived" in result.error


@pytest.mark.parametrize("wrong", ["tokens", "heads", "dtype"])
async def test_a_receive_that_does_not_fit_the_pool_is_a_plan_error(
    make_executor: Callable[..., Executor], linked, wrong: str
) -> None:
    dest = make_executor()
    await linked(dest)
    layers, _, heads, dim = dest.pool.k.shape
    shape = {"tokens": (layers, 3, heads, dim), "heads": (layers, 4, heads + 1, dim)}.get(
        wrong, (layers, 4, heads, dim)
    )
    dtype = torch.float16 if wrong == "dtype" else torch.float32
    k = torch.zeros(shape, dtype=dtype)
    store = dest.transfers.received  # type: ignore[union-attr]
    store.reserve(TransferHeader.of("odd", k, k))
    store.complete("odd", HostCopy(k, k))
    result = dest.execute(_with(make_plan(1), receives=(KvReceive("odd", np.arange(4, dtype=np.int64)),)))
    assert result.error.startswith("receives: transfer 'odd' holds K/V of shape")


async def test_a_receive_without_slots_forgets_a_transfer_even_before_it_arrives(
    make_driver: Callable[..., Driver], make_executor: Callable[..., Executor], linked
) -> None:
    source = make_driver()
    dest = make_executor()
    await linked(source.executor)
    address = await linked(dest)
    source.prefill({1: [5, 6, 7, 8]})
    _run(dest, _with(make_plan(1), receives=(KvReceive("late", np.zeros(0, np.int64)),)))
    slots = source.executor.table.slot_table(1).copy()
    _run(source.executor, _with(make_plan(7), sends=(KvSend("late", address, slots),)))
    [outcome] = await _outcomes(source.executor, 8)
    assert outcome.error == ""  # delivered, and dropped on arrival
    store = dest.transfers.received  # type: ignore[union-attr]
    assert "late" not in store and store.used_bytes == 0


def test_moves_on_a_worker_without_a_transfer_link_are_refused(
    make_executor: Callable[..., Executor],
) -> None:
    executor = make_executor()
    one = np.arange(1, dtype=np.int64)
    for moves in ({"sends": (KvSend("x", "127.0.0.1:9", one),)}, {"receives": (KvReceive("x", one),)}):
        result = executor.execute(_with(make_plan(1), **moves))
        assert "serves no KV transfer link" in result.error
    sim = SimExecutor(64, 100, 2)
    assert (
        "cannot send or receive" in sim.execute(_with(make_plan(1), sends=(KvSend("x", "a:1", one),))).error
    )


def test_moves_cross_the_wire_and_malformed_ones_are_refused_naming_the_field() -> None:
    slots = np.array([3, 1, 2], dtype=np.int64)
    plan = _with(
        make_plan(4), sends=(KvSend("a", "127.0.0.1:5", slots),), receives=(KvReceive("b", slots[:1]),)
    )
    back = worker_codec.plan_from_proto(worker_codec.plan_to_proto(plan).plan)
    assert back.sends[0].transfer_id == "a" and back.sends[0].address == "127.0.0.1:5"
    assert back.sends[0].slots.tolist() == [3, 1, 2] and back.receives[0].slots.tolist() == [3]
    result = StepResult(4, transfers=(TransferOutcome("a", "", 96), TransferOutcome("c", "UNAVAILABLE: x")))
    assert (
        worker_codec.result_from_proto(worker_codec.result_to_proto(result).result).transfers
        == result.transfers
    )
    for bad, field in (
        (KvSend("a", "127.0.0.1:5", slots[:0]), "sends.slots"),
        (KvSend("a", "", slots), "sends.address"),
        (KvSend("", "127.0.0.1:5", slots), "sends.transfer_id"),
    ):
        with pytest.raises(WireError, match=field):
            worker_codec.plan_from_proto(worker_codec.plan_to_proto(_with(make_plan(4), sends=(bad,))).plan)


def test_a_sim_worker_sends_zeros_of_its_models_kv_shape_and_checks_what_it_receives() -> None:
    """The sim moves KV over its link like a real worker, its bytes a real worker's: zeros of shape
    (layers, positions, KV heads, head dim) in float16; a receive takes the transfer when its length
    is the plan's slots (after the skip) and refuses it otherwise."""
    store = TransferStore(1 << 20)
    source, dest = SimExecutor(64, 100, 2, kv_shape=(4, 2, 8)), SimExecutor(64, 100, 2, kv_shape=(4, 2, 8))
    source.transfers = dest.transfers = LoopbackTransfers(store)
    five = np.arange(5, dtype=np.int64)
    nbytes = 2 * 4 * 5 * 2 * 8 * 2  # K and V, float16
    result = source.execute(_with(make_plan(1), sends=(KvSend("t", "d:1", five), KvSend("u", "d:1", five))))
    assert result.error == ""
    assert result.transfers == (TransferOutcome("t", "", nbytes), TransferOutcome("u", "", nbytes))
    assert store.used_bytes == 2 * nbytes
    bad = dest.execute(_with(make_plan(1), receives=(KvReceive("u", five[:3], skip=1),)))
    assert "holds 5 positions, the plan's slots take 4" in bad.error
    good = dest.execute(_with(make_plan(2), receives=(KvReceive("t", five[:3], skip=2),)))
    assert good.error == "" and "t" not in store and store.used_bytes == 0
