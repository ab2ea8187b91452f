"""Round trips through protobuf for every message the worker sends or receives, plans the worker must
refuse to read (each with a message naming the field), and flag parsing."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_plane import codec
from data_plane.config import add_arguments, config_from_args
from data_plane.messages import (
    Census,
    Drain,
    Hello,
    KvReport,
    KvTransfer,
    Move,
    SamplerParams,
    Shutdown,
    StepResult,
    TokenLogprobs,
    Welcome,
)
from protos.stepwise.v1 import worker_pb2
from tests.data_plane.factories import Extend, make_plan, new_seq


def assert_same(a: object, b: object) -> None:
    """Field-by-field equality that understands numpy arrays inside (frozen) dataclasses."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def _wire(message):  # type: ignore[no-untyped-def]
    """Serialise and parse again, as the stream does."""
    return type(message).FromString(message.SerializeToString())


def test_step_plan_round_trip() -> None:
    sampler = SamplerParams(temperature=0.5, top_p=0.875, top_k=40, min_p=0.0625, seed=2**63 + 5, logprobs=3)
    plan = make_plan(
        2**40,
        new_seqs=[new_seq(2**64 - 1, sampler, np.array([4, 9], np.int64), history=[1, 2, 3])],
        extends=[
            Extend(2**64 - 1, 2, [7, 8, 9], np.array([10, 3, 2**40], np.int64)),
            Extend(5, 0, [1], np.array([6])),
        ],
        decodes=[(8, 12), (9, 13)],
        releases=[3, 4],
        offloads=[KvTransfer(6, np.array([1, 2], np.int64))],
        restores=[KvTransfer(7, np.array([5], np.int64))],
    )
    decoded = codec.control_from_proto(worker_pb2.ControlMessage(plan=_wire(codec.plan_to_proto(plan))))
    assert_same(decoded, plan)


def test_unset_proto_sampler_fields_mean_off() -> None:
    assert codec.sampler_from_proto(worker_pb2.SamplerParams()) == SamplerParams()


def test_step_result_round_trip() -> None:
    result = StepResult(
        step_id=9,
        token_ids=np.array([5, 2**31 - 1], np.int64),
        kv=KvReport(live_seqs=2, seq_slots=40, capacity_tokens=4096, device_mem_used_bytes=123, host_seqs=1),
        forward_s=0.25,
        logprobs=(TokenLogprobs(-0.5, (5, 7), (-0.5, -1.5)), TokenLogprobs(-2.0)),
        error="",
        wait_s=0.125,
    )
    assert_same(codec.result_from_proto(_wire(codec.result_to_proto(result)).result), result)


def test_hello_and_control_events_round_trip() -> None:
    hello = Hello(
        "w-1", "ab" * 32, 4096, 16, 2048, 1024, "float32", "cpu", (0, 2), host_pool_capacity_tokens=64
    )
    assert codec.hello_from_proto(_wire(codec.hello_to_proto(hello)).hello) == hello
    welcome = worker_pb2.ControlMessage(welcome=worker_pb2.Welcome(accepted=False, reason="fingerprint"))
    assert codec.control_from_proto(_wire(welcome)) == Welcome(False, "fingerprint")
    bye = worker_pb2.ControlMessage(shutdown=worker_pb2.Shutdown(reason="done"))
    assert codec.control_from_proto(_wire(bye)) == Shutdown("done")
    with pytest.raises(ValueError):
        codec.control_from_proto(worker_pb2.ControlMessage())


def test_move_drain_census_and_a_retryable_refusal_round_trip() -> None:
    busy = worker_pb2.ControlMessage(
        welcome=worker_pb2.Welcome(accepted=False, reason="draining", retryable=True)
    )
    assert codec.control_from_proto(_wire(busy)) == Welcome(False, "draining", retryable=True)
    move = worker_pb2.ControlMessage(move=worker_pb2.Move(reason="rebalance"))
    assert codec.control_from_proto(_wire(move)) == Move("rebalance")
    drain = _wire(codec.drain_to_proto(Drain("SIGTERM")))
    assert (drain.WhichOneof("msg"), drain.drain.reason) == ("drain", "SIGTERM")
    census = Census("cp-1", workers=3, queued=7, running=2**40, accepting=False, model_fingerprint="ab" * 32)
    assert codec.census_from_proto(_wire(codec.census_to_proto(census))) == census
    assert codec.census_from_proto(worker_pb2.CensusReply()) == Census(accepting=False)


def test_flags_build_a_frozen_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--model", "/m", "--kv-tokens", "512", "--page-size", "16", "--control", "h:1"])
    config = config_from_args(ns)
    assert (config.model, config.kv_tokens, config.page_size, config.control) == (
        pathlib.Path("/m"),
        512,
        16,
        "h:1",
    )
    assert config.worker_id  # hostname-pid by default
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.page_size = 1  # type: ignore[misc]
    with pytest.raises(SystemExit):  # out of its flag's range (tests/cli/test_flag_table.py)
        parser.parse_args(["--model", "/m", "--page-size", "0"])


# ---- plans the worker refuses to read -------------------------------------------------------------


def _decode_plan(step_id: int, decodes: list[tuple[int, int]], releases: tuple[int, ...] = ()):  # type: ignore[no-untyped-def]
    return make_plan(step_id, decodes=decodes, releases=releases)


def _decoder_holding(handles: list[int]) -> codec.PlanDecoder:
    """A decoder whose decode set is `handles`, at slots 100, 101, ..."""
    decoder = codec.PlanDecoder()
    decoder.plan(codec.plan_to_proto(_decode_plan(1, [(h, 100 + i) for i, h in enumerate(handles)])))
    return decoder


def _delta(count: int, **fields) -> worker_pb2.StepPlan:  # type: ignore[no-untyped-def]
    return worker_pb2.StepPlan(step_id=2, decodes=worker_pb2.DecodeBatch(count=count, **fields))


BAD_DELTAS = {
    "is not in the decode set": _delta(2, left=[9]),
    "handle 2 is in decodes.joined but already in the set": _delta(
        4, joined=[2], run_entries=[3], run_slots=[5], run_lens=[1]
    ),
    "names a handle that decodes.left takes out": _delta(
        3, left=[2], joined=[2], run_entries=[2], run_slots=[5], run_lens=[1]
    ),
    "appears more than once": _delta(2, left=[1, 1]),
    "count says 5": _delta(5),
    "no run gives its slot": _delta(4, joined=[7]),
    "run_entries: value 3 is outside": _delta(3, run_entries=[3], run_slots=[0], run_lens=[1]),
    "run_lens: value 0 is outside": _delta(3, run_entries=[0], run_slots=[0], run_lens=[0]),
    "run_slots: value -1 is outside": _delta(3, run_entries=[0], run_slots=[-1], run_lens=[1]),
    "runs overlap": _delta(3, run_entries=[0, 1], run_slots=[0, 9], run_lens=[2, 1]),
    "pass the last entry": _delta(3, run_entries=[1], run_slots=[0], run_lens=[3]),
    "runs of 1 entries, 2 slots": _delta(3, run_entries=[0], run_slots=[0, 1], run_lens=[1]),
    "not empty although count is 0": _delta(0, left=[1]),
    "full and left/joined at once": _delta(3, full=[1, 2, 3], left=[1]),
    "handle 4 appears more than once": _delta(2, full=[4, 4], run_entries=[0], run_slots=[0], run_lens=[2]),
    "count: -1 is negative": _delta(-1),
}


@pytest.mark.parametrize("message", list(BAD_DELTAS))
def test_a_bad_decode_delta_is_refused_naming_the_field(message: str) -> None:
    decoder = _decoder_holding([1, 2, 3])
    with pytest.raises(ValueError, match=message):
        decoder.plan(_wire(BAD_DELTAS[message]))
    # The refused plan changed nothing: the set it diffs against is still [1, 2, 3].
    plan = decoder.plan(_wire(_delta(2, left=[2])))
    assert plan.decodes.handles.tolist() == [1, 3] and plan.decodes.slots.tolist() == [101, 103]


def test_a_released_handle_must_leave_the_decode_set() -> None:
    decoder = _decoder_holding([1, 2, 3])
    with pytest.raises(ValueError, match="handle 2 is released by this plan but still in its decode set"):
        decoder.plan(_wire(worker_pb2.StepPlan(step_id=2, release_handles=[2], decodes=_delta(3).decodes)))
    plan = decoder.plan(
        _wire(worker_pb2.StepPlan(step_id=2, release_handles=[2], decodes=_delta(2, left=[2]).decodes))
    )
    assert plan.decodes.handles.tolist() == [1, 3]


def test_a_plan_without_decodes_keeps_the_set_and_a_reset_empties_it() -> None:
    decoder = _decoder_holding([1, 2])
    assert len(decoder.plan(_wire(worker_pb2.StepPlan(step_id=2))).decodes.handles) == 0
    assert decoder.plan(_wire(_delta(2))).decodes.slots.tolist() == [101, 102]
    reset = worker_pb2.StepPlan(step_id=4, reset=True, decodes=_delta(2).decodes)
    with pytest.raises(ValueError, match="the delta makes 0 entries, count says 2"):
        decoder.plan(_wire(reset))


BAD_ARRAYS = {
    "extends.token_ids: 6 bytes is not a whole number of 4-byte values": worker_pb2.StepPlan(
        extends=worker_pb2.ExtendBatch(token_ids=b"\x01" * 6)
    ),
    "extends.slots: value -2 at index 1 is negative": worker_pb2.StepPlan(
        extends=worker_pb2.ExtendBatch(slots=np.array([3, -2], "<i8").tobytes())
    ),
    "new_seqs.prefix_slots: 7 bytes": worker_pb2.StepPlan(
        new_seqs=[worker_pb2.NewSequence(handle=1, prefix_slots=b"\x00" * 7)]
    ),
    "offloads.slots": worker_pb2.StepPlan(offloads=[worker_pb2.KvTransfer(handle=1, slots=b"\x00" * 9)]),
    "remaps.slots": worker_pb2.StepPlan(remaps=[worker_pb2.SlotRemap(handle=1, slots=b"\xff" * 8)]),
}


@pytest.mark.parametrize("message", list(BAD_ARRAYS))
def test_a_malformed_array_is_refused_naming_it(message: str) -> None:
    with pytest.raises(ValueError, match=message):
        codec.control_from_proto(worker_pb2.ControlMessage(plan=_wire(BAD_ARRAYS[message])))


SMALL = st.lists(st.integers(-2, 8), max_size=5)


@settings(max_examples=500, deadline=None)
@given(
    count=st.integers(-1, 8),
    full=st.lists(st.integers(0, 8), max_size=5),
    left=st.lists(st.integers(0, 8), max_size=3),
    joined=st.lists(st.integers(0, 8), max_size=3),
    runs=st.tuples(SMALL, SMALL, SMALL),
)
def test_any_decode_batch_is_read_or_refused_with_a_value_error(count, full, left, joined, runs) -> None:  # type: ignore[no-untyped-def]
    """Whatever a DecodeBatch holds, the decoder answers a consistent decode set or a ValueError:
    never another exception, never a set that repeats a handle or leaves an entry without a slot."""
    decoder = _decoder_holding([1, 2, 3])
    entries, slots, lens = runs
    batch = worker_pb2.DecodeBatch(
        count=count, full=full, left=left, joined=joined, run_entries=entries, run_slots=slots, run_lens=lens
    )
    try:
        plan = decoder.plan(_wire(worker_pb2.StepPlan(step_id=2, decodes=batch)))
    except ValueError:
        return
    handles, decoded_slots = plan.decodes.handles, plan.decodes.slots
    assert len(handles) == max(count, 0) == len(decoded_slots)
    assert len(set(handles.tolist())) == len(handles)
    assert all(s >= 0 for s in decoded_slots.tolist())
