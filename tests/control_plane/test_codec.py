"""Round trips through control_plane.codec, the worker link's delta plans through both planes'
codecs, results checked against their plans, and client-input validation naming the field."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane import client_codec, worker_codec
from control_plane.config import SchedulerConfig
from control_plane.core.handover import WorkerGone
from control_plane.core.worker_checks import WorkerFault
from control_plane.core.worker_link import StreamChannel
from control_plane.record import codec as record_codec
from control_plane.record.entries import Header
from control_plane.record.files import varint
from control_plane.request import SamplerSpec
from control_plane.scheduler.plan import (
    DecodeWork,
    ExtendWork,
    KvReport,
    KvTransfer,
    NewSeq,
    SlotRemap,
    StepKind,
    StepPlan,
    StepResult,
    TokenLogprobs,
    WorkerLimits,
)
from data_plane import codec as data_codec
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import worker_pb2 as wk_pb
from stepwise import replay


def _i64(*v: int) -> np.ndarray:
    return np.asarray(v, dtype=np.int64)


def _assert_same(a: object, b: object) -> None:
    """Dataclass equality that compares numpy fields by value."""
    assert type(a) is type(b)
    for name in a.__slots__:  # type: ignore[attr-defined]
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        elif isinstance(x, tuple) and x and hasattr(x[0], "__slots__"):
            assert len(x) == len(y)
            for p, q in zip(x, y, strict=True):
                _assert_same(p, q)
        elif hasattr(x, "__slots__") and not isinstance(x, StepKind):
            _assert_same(x, y)
        else:
            assert x == y, name


def test_plan_round_trip() -> None:
    plan = StepPlan(
        step_id=7,
        kind=StepKind.MIXED,
        releases=_i64(3, 4),
        offloads=(KvTransfer(9, _i64(1, 2)),),
        restores=(KvTransfer(10, _i64(5)),),
        new_seqs=(
            NewSeq(11, SamplerSpec(temperature=0.5, top_k=3, seed=42), _i64(8, 9), np.asarray([1], np.int32)),
        ),
        extends=ExtendWork(
            handles=_i64(11, 12),
            starts=np.asarray([2, 0], np.int32),
            lens=np.asarray([1, 2], np.int32),
            sample=np.asarray([True, False]),
            token_ids=np.asarray([5, 6, 7], np.int32),
            slots=_i64(20, 21, 22),
        ),
        decodes=DecodeWork(handles=_i64(1, 2), slots=_i64(30, 31)),
        remaps=(SlotRemap(12, 0, _i64(40, 41)),),
    )
    _assert_same(worker_codec.plan_from_proto(worker_codec.plan_to_proto(plan).plan), plan)


def test_result_round_trip() -> None:
    result = StepResult(
        step_id=3,
        token_ids=np.asarray([9, 8], np.int32),
        # One entry per sampled token (the sampler's contract when any row asks for logprobs).
        logprobs=(TokenLogprobs(-0.5, (1, 2), (-0.5, -1.0)), TokenLogprobs(-0.25)),
        kv=KvReport(live_seqs=2, seq_slots=10, capacity_tokens=100, device_mem_used_bytes=5, host_seqs=1),
        forward_s=0.25,
        wait_s=0.5,
        error="",
    )
    _assert_same(
        worker_codec.result_from_proto(worker_codec.result_to_proto(result).result, sampled=2), result
    )


def _decode_plan(
    step_id: int, handles: list[int], slots: list[int], releases: tuple[int, ...] = ()
) -> StepPlan:
    return StepPlan(
        step_id,
        StepKind.DECODE,
        releases=_i64(*releases),
        decodes=DecodeWork(handles=_i64(*handles), slots=_i64(*slots)),
    )


def _wire(message):  # type: ignore[no-untyped-def]
    return type(message).FromString(message.SerializeToString())


# --- the decode set as a delta (protos/decode_set.py), both planes' codecs ----------------------------


@st.composite
def decode_sessions(draw: st.DrawFn) -> list[StepPlan]:
    """Plans of one link: decode sets that lose and gain members, get reordered, released or reset,
    with plans without decode work between them, and slots that follow on, jump, or come in blocks."""
    plans: list[StepPlan] = []
    members: list[int] = []
    slot_of: dict[int, int] = {}
    next_handle = draw(st.sampled_from([1, 2**40, 2**63 - 64]))
    for step in range(1, draw(st.integers(1, 14)) + 1):
        move = draw(st.sampled_from(["decode", "decode", "decode", "none", "reorder", "reset"]))
        if move == "none":
            plans.append(StepPlan(step, StepKind.PREFILL))
            continue
        gone = draw(st.lists(st.sampled_from(members), unique=True)) if members and move != "reset" else []
        members = [h for h in members if h not in gone] if move != "reset" else []
        if move == "reorder":
            members = list(draw(st.permutations(members)))
        joined = draw(st.integers(0 if members else 1, 6))
        members += range(next_handle, next_handle + joined)
        next_handle += joined
        slots = _slots(draw, members, slot_of)
        slot_of.update(zip(members, slots, strict=True))
        released = draw(st.lists(st.sampled_from(gone), unique=True)) if gone else []
        plan = _decode_plan(step, members, slots, tuple(released))
        plans.append(dataclasses.replace(plan, reset=move == "reset"))
    return plans


def _slots(draw: st.DrawFn, members: list[int], slot_of: dict[int, int]) -> list[int]:
    pattern = draw(st.sampled_from(["next", "block", "random", "mixed"]))
    base = draw(st.integers(0, 2**40))
    if pattern == "block":
        return [base + i for i in range(len(members))]
    if pattern == "random":
        return [draw(st.integers(0, 2**62)) for _ in members]
    mixed = pattern == "mixed"
    return [
        slot_of[h] + 1 if h in slot_of and not (mixed and draw(st.booleans())) else draw(st.integers(0, 999))
        for h in members
    ]


@settings(max_examples=300, deadline=None)
@given(plans=decode_sessions())
def test_the_worker_rebuilds_every_decode_set_from_the_deltas(plans: list[StepPlan]) -> None:
    encoder, decoder, twin = worker_codec.PlanEncoder(), data_codec.PlanDecoder(), worker_codec.PlanEncoder()
    for plan in plans:
        wire = _wire(encoder.encode(plan)).plan
        # A twin fed private copies: an encoder that kept references to the plan's arrays would
        # diff the next plan against what the scheduler wrote into them since.
        assert twin.encode(_copied(plan)).plan == wire
        decoded = decoder.plan(wire)
        alone = data_codec.plan_from_proto(_wire(worker_codec.plan_to_proto(plan)).plan)
        for worker_plan in (decoded, alone):
            assert worker_plan.decodes.handles.astype(np.int64).tolist() == plan.decodes.handles.tolist()
            assert worker_plan.decodes.slots.tolist() == plan.decodes.slots.tolist()
        assert wire.decodes.count == len(plan.decodes)
        # The scheduler reuses its arrays: what the encoder kept must not change with them.
        plan.decodes.slots[:] = -7
        plan.decodes.handles[:] = 0


def _copied(plan: StepPlan) -> StepPlan:
    decodes = DecodeWork(plan.decodes.handles.copy(), plan.decodes.slots.copy())
    return dataclasses.replace(plan, decodes=decodes, releases=plan.releases.copy())


def test_a_steady_decode_plan_sends_only_what_changed() -> None:
    encoder, decoder = worker_codec.PlanEncoder(), data_codec.PlanDecoder()
    first = _decode_plan(1, [10, 11, 12, 13], [40, 80, 120, 160])
    second = _decode_plan(2, [10, 12, 13, 14], [41, 121, 200, 300], releases=(11,))
    decoder.plan(_wire(encoder.encode(first)).plan)
    wire = _wire(encoder.encode(second)).plan
    assert not wire.decodes.full and list(wire.decodes.left) == [11] and list(wire.decodes.joined) == [14]
    # 10 and 12 write after their last slot; 13 jumped to a new page and 14 is new: one run of two.
    runs = list(zip(wire.decodes.run_entries, wire.decodes.run_slots, wire.decodes.run_lens, strict=True))
    assert runs == [(2, 200, 1), (3, 300, 1)]
    assert decoder.plan(wire).decodes.slots.tolist() == [41, 121, 200, 300]


def test_a_reordered_set_goes_in_full_and_keeps_its_default_slots() -> None:
    encoder = worker_codec.PlanEncoder()
    encoder.encode(_decode_plan(1, [1, 2, 3], [10, 20, 30]))
    wire = encoder.encode(_decode_plan(2, [3, 1, 2], [31, 11, 21])).plan
    assert list(wire.decodes.full) == [3, 1, 2] and not wire.decodes.run_entries


def test_a_reset_plan_starts_the_decode_set_over() -> None:
    encoder = worker_codec.PlanEncoder()
    encoder.encode(_decode_plan(1, [1, 2, 3], [10, 20, 30]))
    reset = dataclasses.replace(_decode_plan(2, [1, 2, 3], [11, 21, 31]), reset=True)
    wire = encoder.encode(reset).plan
    assert list(wire.decodes.full) == [1, 2, 3] and list(wire.decodes.run_lens) == [1, 1, 1]


def test_a_plan_that_cannot_be_encoded_leaves_the_encoder_as_it_was() -> None:
    encoder, decoder = worker_codec.PlanEncoder(), data_codec.PlanDecoder()
    decoder.plan(_wire(encoder.encode(_decode_plan(1, [1, 2], [10, 20]))).plan)
    with pytest.raises(ValueError, match="handle 2 appears more than once"):
        encoder.encode(_decode_plan(2, [1, 2, 2], [11, 21, 22]))
    assert decoder.plan(
        _wire(encoder.encode(_decode_plan(3, [1, 2], [11, 21]))).plan
    ).decodes.slots.tolist() == [
        11,
        21,
    ]


def _steady_plans(running: int, page_size: int, steps: int = 4) -> list[StepPlan]:
    """Decode plans of `running` sequences, no churn. Page 1: the allocator hands out one contiguous
    block per step. Page 16: each sequence fills its own page; lengths are staggered, so every step
    1/16 of them start a new page (drawn at random)."""
    rng = np.random.default_rng(page_size)
    handles = list(range(1000, 1000 + running))
    lengths = rng.integers(100, 2000, size=running)
    pages = rng.permutation(1 << 20)[:running] * page_size
    plans = []
    for step in range(steps):
        if page_size == 1:
            slots = 5_000_000 + step * running + np.arange(running)
        else:
            turning = (lengths + step) % page_size == 0
            pages[turning] = rng.integers(0, 1 << 20, size=int(turning.sum())) * page_size
            slots = pages + (lengths + step) % page_size
        plans.append(_decode_plan(step + 1, handles, slots.tolist()))
    return plans


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_steady_decode_plan_at_1024_running_fits_in_a_kilobyte(page_size: int) -> None:
    encoder, decoder = worker_codec.PlanEncoder(), data_codec.PlanDecoder()
    sizes = []
    for plan in _steady_plans(1024, page_size):
        message = encoder.encode(plan)
        sizes.append(message.ByteSize())
        assert decoder.plan(_wire(message).plan).decodes.slots.tolist() == plan.decodes.slots.tolist()
    assert sizes[0] > 1024 * 2  # the first decode plan names every handle
    assert max(sizes[1:]) <= 1024, sizes


# --- results checked against what the plan sampled ---------------------------------------------------


def _wire_result(**fields: object) -> wk_pb.StepResult:
    return wk_pb.StepResult(step_id=4, **fields)  # type: ignore[arg-type]


BAD_RESULTS = {
    "has 3 tokens; the plan sampled 2": _wire_result(token_ids=np.array([1, 2, 3], "<i4").tobytes()),
    "not a whole number of 4-byte values": _wire_result(token_ids=b"\x01\x00\x00\x00\x02"),
    "value -3 at index 1 is negative": _wire_result(token_ids=np.array([1, -3], "<i4").tobytes()),
    "wait_s nan is not a duration": _wire_result(
        token_ids=np.array([1, 2], "<i4").tobytes(), wait_s=math.nan
    ),
    "forward_s -1.0 is not a duration": _wire_result(
        token_ids=np.array([1, 2], "<i4").tobytes(), forward_s=-1
    ),
    "1 logprobs for 2 tokens": _wire_result(
        token_ids=np.array([1, 2], "<i4").tobytes(), logprobs=[wk_pb.TokenLogprobs(logprob=-1)]
    ),
}


@pytest.mark.parametrize("message", list(BAD_RESULTS))
def test_a_result_that_does_not_answer_its_plan_is_a_protocol_error(message: str) -> None:
    with pytest.raises(worker_codec.ProtocolError, match=message):
        worker_codec.result_from_proto(BAD_RESULTS[message], sampled=2)


def test_an_error_result_carries_no_tokens() -> None:
    result = worker_codec.result_from_proto(_wire_result(error="out of memory"), sampled=5)
    assert result.error == "out of memory" and len(result.token_ids) == 0


def test_sampled_count_is_sampling_extends_plus_decodes() -> None:
    plan = StepPlan(
        1,
        StepKind.MIXED,
        extends=ExtendWork(
            handles=_i64(5, 6, 7),
            starts=np.zeros(3, np.int32),
            lens=np.ones(3, np.int32),
            sample=np.asarray([True, False, True]),
            token_ids=np.ones(3, np.int32),
            slots=_i64(1, 2, 3),
        ),
        decodes=DecodeWork(handles=_i64(1, 2), slots=_i64(8, 9)),
    )
    assert worker_codec.sampled_count(plan) == 4


# --- recordings ----------------------------------------------------------------------------------------


def test_a_recording_in_an_older_format_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = Header(SchedulerConfig(), WorkerLimits("w", 64, 1, 128, 100, frozenset({2})))
    record = record_codec.entry_to_proto(header)
    assert record.header.format_version == record_codec.FORMAT_VERSION == 2
    assert record_codec.decode(record.SerializeToString()).format_version == 2  # type: ignore[union-attr]
    record.header.format_version = 1
    path = tmp_path / "old.rec"
    body = record.SerializeToString()
    path.write_bytes(varint(len(body)) + body)
    for what in ("scheduler", "worker", "show"):
        assert replay.main([what, str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"stepwise replay: {path}: " + record_codec.unsupported_format(
            dataclasses.replace(header, format_version=1)
        )
        assert "format 1 is not supported" in err and "\n" not in err


def test_hello_round_trip() -> None:
    limits = WorkerLimits("w", 1000, 4, 2048, 1024, frozenset({0, 2}), "abc", "float32", "cpu", 64)
    assert worker_codec.limits_from_hello(worker_codec.hello_from_limits(limits)) == limits


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (gen_pb.SamplingParams(max_new_tokens=-1), "sampling.max_new_tokens"),
        (gen_pb.SamplingParams(temperature=-1), "sampling.temperature"),
        (gen_pb.SamplingParams(temperature=float("inf")), "sampling.temperature"),
        (gen_pb.SamplingParams(top_p=float("nan")), "sampling.top_p"),
        (gen_pb.SamplingParams(frequency_penalty=float("-inf")), "sampling.frequency_penalty"),
        (gen_pb.SamplingParams(presence_penalty=float("nan")), "sampling.presence_penalty"),
        (gen_pb.SamplingParams(stop=["x"] * 65), "sampling.stop"),
        (gen_pb.SamplingParams(stop=["x" * 4097]), "sampling.stop"),
        (gen_pb.SamplingParams(stop_token_ids=list(range(1025))), "sampling.stop_token_ids"),
        (gen_pb.SamplingParams(top_p=0.0), "sampling.top_p"),
        (gen_pb.SamplingParams(top_p=1.01), "sampling.top_p"),
        (gen_pb.SamplingParams(top_k=-2), "sampling.top_k"),
        (gen_pb.SamplingParams(min_p=2), "sampling.min_p"),
        (gen_pb.SamplingParams(repetition_penalty=0), "sampling.repetition_penalty"),
        (gen_pb.SamplingParams(stop=[""]), "sampling.stop"),
    ],
)
def test_invalid_sampling_names_the_field(sampling: gen_pb.SamplingParams, field: str) -> None:
    with pytest.raises(client_codec.InvalidArgument, match=field.replace(".", r"\.")):
        client_codec.generate_input_from_proto(gen_pb.GenerateRequest(text="hi", sampling=sampling))


def test_prompt_is_required_and_non_empty() -> None:
    with pytest.raises(client_codec.InvalidArgument, match="prompt"):
        client_codec.generate_input_from_proto(gen_pb.GenerateRequest())
    with pytest.raises(client_codec.InvalidArgument, match="text"):
        client_codec.generate_input_from_proto(gen_pb.GenerateRequest(text=""))


def test_unknown_token_id_names_index() -> None:
    with pytest.raises(client_codec.InvalidArgument, match="index 1"):
        client_codec.check_token_ids([1, 5000], vocab_size=1024)


def test_defaults_when_unset() -> None:
    inp = client_codec.generate_input_from_proto(gen_pb.GenerateRequest(text="hi"))
    assert inp.params.max_new_tokens is None
    assert inp.params.sampler == SamplerSpec()
    assert inp.params.priority is None


# --- the worker link (control_plane/core/worker_link.py) over a stand-in stream -----------------------


class _Stream:
    """A Connect stream's server side: what the link wrote, and the worker's replies to read."""

    def __init__(self, replies: list[object]) -> None:
        self.written: list[wk_pb.ControlMessage] = []
        self.replies = replies

    async def write(self, message: wk_pb.ControlMessage) -> None:
        self.written.append(message)

    async def read(self) -> object:
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def _reply(step_id: int, tokens: list[int]) -> wk_pb.WorkerMessage:
    result = wk_pb.StepResult(step_id=step_id, token_ids=np.asarray(tokens, "<i4").tobytes(), wait_s=0.25)
    return wk_pb.WorkerMessage(result=result)


async def test_the_link_keeps_plans_in_flight_and_reads_their_results_in_order() -> None:
    stream = _Stream([_reply(1, [5, 6]), _reply(2, [7, 8])])
    link = StreamChannel(stream)  # type: ignore[arg-type]
    await link.send(_decode_plan(1, [1, 2], [10, 20]))
    await link.send(_decode_plan(2, [1, 2], [11, 21]))
    assert link.in_flight == 2
    first, second = await link.receive(), await link.receive()
    assert (first.step_id, first.token_ids.tolist(), first.wait_s) == (1, [5, 6], 0.25)
    assert (second.step_id, second.token_ids.tolist(), link.in_flight) == (2, [7, 8], 0)
    # The second plan went as a delta: same members, each one slot on, so nothing but the count.
    assert stream.written[1].plan.decodes == wk_pb.DecodeBatch(count=2)
    with pytest.raises(RuntimeError, match="no plan in flight"):
        await link.receive()


@pytest.mark.parametrize(
    ("reply", "error", "message"),
    [
        (_reply(1, [5]), WorkerFault, "has 1 tokens; the plan sampled 2"),
        (wk_pb.WorkerMessage(hello=wk_pb.Hello()), WorkerFault, "expected a step result, got hello"),
        (wk_pb.WorkerMessage(), WorkerFault, "got an empty message"),
        (None, WorkerGone, "stream closed"),
        (ConnectionResetError("reset by peer"), WorkerGone, "ConnectionResetError: reset by peer"),
    ],
)
async def test_a_bad_reply_is_a_worker_fault_and_a_broken_stream_a_lost_worker(
    reply: object, error: type[Exception], message: str
) -> None:
    link = StreamChannel(_Stream([reply]))  # type: ignore[arg-type]
    await link.send(_decode_plan(1, [1, 2], [10, 20]))
    with pytest.raises(error, match=message):
        await link.receive()
