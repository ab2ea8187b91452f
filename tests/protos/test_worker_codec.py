"""The worker link's one codec (protos/worker_codec.py), as both planes use it: a round trip for every
message, the decode set as a delta between one link's PlanEncoder and PlanDecoder, plans the worker
refuses to read (each with a message naming the field), results the control plane refuses (a
ProtocolError), and what proto3's unset fields read as."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos import worker_codec
from protos.arrays import WireError
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.worker import (
    PROTOCOL_VERSION,
    Census,
    DecodeWork,
    Drain,
    Dropped,
    ExtendWork,
    KvReport,
    KvTransfer,
    Move,
    NewSeq,
    SamplerParams,
    Shutdown,
    SlotRemap,
    StepKind,
    StepPlan,
    StepResult,
    TokenLogprobs,
    TransferOutcome,
    Welcome,
    WorkerLimits,
    sampled_count,
    sampled_handles,
)
from tests.data_plane.factories import Extend, make_plan, new_seq

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _i64(*v: int) -> np.ndarray:
    return np.asarray(v, dtype=np.int64)


def _i32(*v: int) -> np.ndarray:
    return np.asarray(v, dtype=np.int32)


def assert_same(a: object, b: object) -> None:
    """Field-by-field equality that understands numpy arrays (dtype included) inside dataclasses."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), (a, b)
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def _wire(message):  # type: ignore[no-untyped-def]
    """Serialise and parse again, as the stream does."""
    return type(message).FromString(message.SerializeToString())


def _alone(plan: StepPlan) -> StepPlan:
    """A plan on its own through the wire: plan_to_proto, bytes, plan_from_proto."""
    return worker_codec.plan_from_proto(_wire(worker_codec.plan_to_proto(plan)).plan)


# --- strategies: every field of every message, in the values the wire can carry ---------------------

_F32 = {"width": 32, "allow_nan": False, "allow_infinity": False}
samplers = st.builds(
    SamplerParams,
    temperature=st.floats(0, 4, **_F32),
    top_p=st.floats(0, 1, exclude_min=True, **_F32),
    top_k=st.integers(0, INT32_MAX),
    min_p=st.floats(0, 1, **_F32),
    repetition_penalty=st.floats(0, 4, exclude_min=True, **_F32),
    frequency_penalty=st.floats(-2, 2, **_F32),
    presence_penalty=st.floats(-2, 2, **_F32),
    seed=st.none() | st.integers(0, 2**64 - 1),
    logprobs=st.integers(0, 20),
    logit_bias=st.dictionaries(st.integers(0, INT32_MAX), st.floats(-100, 100, **_F32), max_size=4).map(
        lambda biases: tuple(sorted(biases.items()))
    ),
)
handles = st.integers(0, INT64_MAX)
slot_arrays = st.lists(st.integers(0, INT64_MAX), max_size=6).map(lambda v: _i64(*v))
small = st.integers(0, INT32_MAX)
texts = st.text(max_size=12)


@st.composite
def plans(draw: st.DrawFn) -> StepPlan:
    """Any plan the scheduler could build: distinct handles per column, releases not decoding."""
    pool = draw(st.lists(handles, unique=True, max_size=24))
    decoding, extending, releasing = pool[:8], pool[8:14], pool[14:18]
    decodes = DecodeWork()
    if decoding:
        decodes = DecodeWork(
            _i64(*decoding),
            _i64(*draw(st.lists(st.integers(0, 2**62), min_size=len(decoding), max_size=len(decoding)))),
        )
    extends = draw(_extends(extending))
    transfers = st.builds(KvTransfer, handles, slot_arrays)
    new_seqs = st.builds(
        NewSeq,
        handles,
        samplers,
        prefix_slots=slot_arrays,
        history_ids=st.lists(small, max_size=5).map(lambda v: _i32(*v)),
        request_id=texts,
        prompt_len=small,
        sim_output_len=small,
    )
    return StepPlan(
        draw(st.integers(0, 2**64 - 1)),
        StepKind.of(len(extends), len(decodes)),
        releases=_i64(*releasing),
        offloads=tuple(draw(st.lists(transfers, max_size=2))),
        restores=tuple(draw(st.lists(transfers, max_size=2))),
        new_seqs=tuple(draw(st.lists(new_seqs, max_size=3))),
        extends=extends,
        decodes=decodes,
        remaps=tuple(draw(st.lists(st.builds(SlotRemap, handles, small, slot_arrays), max_size=2))),
        reset=draw(st.booleans()),
    )


@st.composite
def _extends(draw: st.DrawFn, members: list[int]) -> ExtendWork:
    if not members:
        return ExtendWork()
    n = len(members)
    lens = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    total = sum(lens)
    return ExtendWork(
        handles=_i64(*members),
        starts=_i32(*draw(st.lists(small, min_size=n, max_size=n))),
        lens=_i32(*lens),
        sample=np.asarray(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool),
        token_ids=_i32(*draw(st.lists(small, min_size=total, max_size=total))),
        slots=_i64(*draw(st.lists(st.integers(0, INT64_MAX), min_size=total, max_size=total))),
    )


durations = st.floats(0, 1e6, allow_nan=False)
results = st.builds(
    StepResult,
    st.integers(0, 2**64 - 1),
    token_ids=st.lists(small, max_size=6).map(lambda v: _i32(*v)),
    kv=st.builds(KvReport, *[st.integers(0, INT64_MAX)] * 5),
    forward_s=durations,
    wait_s=durations,
    error=texts,
)
limits = st.builds(
    WorkerLimits,
    texts,
    st.integers(0, INT64_MAX),
    st.integers(1, INT32_MAX),
    small,
    small,
    eos_token_ids=st.frozensets(small, max_size=4),
    model_fingerprint=texts,
    dtype=texts,
    device=texts,
    host_pool_capacity_tokens=st.integers(0, INT64_MAX),
    protocol_version=st.integers(0, 9),
)
censuses = st.builds(
    Census,
    texts,
    small,
    st.integers(0, INT64_MAX),
    st.integers(0, INT64_MAX),
    st.booleans(),
    texts,
    hello_judged=st.booleans(),
    refusal=texts,
)


# --- round trips -------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(plan=plans())
def test_any_plan_survives_the_wire_alone_and_as_a_links_first_plan(plan: StepPlan) -> None:
    assert_same(_alone(plan), plan)
    first = worker_codec.PlanEncoder().encode(plan)
    assert_same(worker_codec.PlanDecoder().control(_wire(first)), plan)


def test_a_plan_with_every_field_set_round_trips() -> None:
    plan = StepPlan(
        step_id=7,
        kind=StepKind.MIXED,
        releases=_i64(3, 4),
        offloads=(KvTransfer(9, _i64(1, 2)),),
        restores=(KvTransfer(10, _i64(5)),),
        new_seqs=(NewSeq(11, SamplerParams(temperature=0.5, top_k=3, seed=42), _i64(8, 9), _i32(1)),),
        extends=ExtendWork(
            handles=_i64(11, 12),
            starts=_i32(2, 0),
            lens=_i32(1, 2),
            sample=np.asarray([True, False]),
            token_ids=_i32(5, 6, 7),
            slots=_i64(20, 21, 22),
        ),
        decodes=DecodeWork(handles=_i64(1, 2), slots=_i64(30, 31)),
        remaps=(SlotRemap(12, 0, _i64(40, 41)),),
    )
    assert_same(_alone(plan), plan)


def test_a_plan_built_by_the_worker_tests_factories_round_trips_at_the_edges() -> None:
    """The largest handle and seed the wire allows, and the decoded plan's kind derived from it."""
    sampler = SamplerParams(temperature=0.5, top_p=0.875, top_k=40, min_p=0.0625, seed=2**64 - 1, logprobs=3)
    plan = make_plan(
        2**40,
        new_seqs=[new_seq(INT64_MAX, sampler, _i64(4, 9), history=[1, 2, 3])],
        extends=[Extend(INT64_MAX, 2, [7, 8, 9], _i64(10, 3, 2**40)), Extend(5, 0, [1], _i64(6))],
        decodes=[(8, 12), (9, 13)],
        releases=[3, 4],
        offloads=[KvTransfer(6, _i64(1, 2))],
        restores=[KvTransfer(7, _i64(5))],
    )
    assert plan.kind is StepKind.MIXED
    assert_same(worker_codec.control_from_proto(_wire(worker_codec.plan_to_proto(plan))), plan)


@settings(max_examples=200, deadline=None)
@given(result=results, logprob=st.floats(-100, 0, **_F32))
def test_any_result_survives_the_wire(result: StepResult, logprob: float) -> None:
    # One logprob entry per token, or none (the sampler's contract when any row asks for them).
    with_logprobs = dataclasses.replace(
        result, logprobs=tuple(TokenLogprobs(logprob, (1, 2), (logprob, -1.0)) for _ in result.token_ids)
    )
    for sent in (result, with_logprobs):
        wire = _wire(worker_codec.result_to_proto(sent)).result
        assert_same(worker_codec.result_from_proto(wire, sampled=len(sent.token_ids)), sent)


def test_a_result_with_every_field_set_round_trips() -> None:
    result = StepResult(
        step_id=3,
        token_ids=_i32(9, INT32_MAX),
        logprobs=(TokenLogprobs(-0.5, (1, 2), (-0.5, -1.0)), TokenLogprobs(-0.25)),
        kv=KvReport(live_seqs=2, seq_slots=10, capacity_tokens=100, device_mem_used_bytes=5, host_seqs=1),
        forward_s=0.25,
        wait_s=0.5,
        grammar_failed=_i32(1),
    )
    assert_same(worker_codec.result_from_proto(_wire(worker_codec.result_to_proto(result)).result, 2), result)


@pytest.mark.parametrize("failed", [[2], [1, 1], [1, 0]], ids=["past-the-tokens", "repeated", "descending"])
def test_grammar_failed_must_name_the_results_samples_in_order(failed: list[int]) -> None:
    wire = worker_codec.result_to_proto(StepResult(3, _i32(9, 10))).result
    wire.grammar_failed.extend(failed)
    with pytest.raises(worker_codec.ProtocolError, match="grammar_failed must be ascending indices below 2"):
        worker_codec.result_from_proto(wire, 2)


def test_the_workers_int64_tokens_go_on_the_wire_as_int32() -> None:
    """The executor's sampler answers int64 token ids; the wire and the decoded result are int32."""
    wide = StepResult(4, np.asarray([5, INT32_MAX], dtype=np.int64))
    narrow = dataclasses.replace(wide, token_ids=_i32(5, INT32_MAX))
    wire = worker_codec.result_to_proto(wide)
    assert wire == worker_codec.result_to_proto(narrow)
    assert_same(worker_codec.result_from_proto(wire.result), narrow)


@settings(max_examples=200, deadline=None)
@given(sampler=samplers)
def test_any_sampler_survives_the_wire(sampler: SamplerParams) -> None:
    assert worker_codec.sampler_from_proto(_wire(worker_codec.sampler_to_proto(sampler))) == sampler


def test_unset_proto_sampler_fields_mean_off() -> None:
    """Defect (the control side read an empty SamplerParams as top_p 0 and repetition_penalty 0)."""
    assert worker_codec.sampler_from_proto(wk_pb.SamplerParams()) == SamplerParams()
    assert not SamplerParams().uses_penalties
    assert SamplerParams().temperature == 0.0  # greedy: the client protocol's 1.0 is client_codec's


def test_out_of_range_sampler_fields_read_as_off() -> None:
    read = worker_codec.sampler_from_proto(
        wk_pb.SamplerParams(
            temperature=-1, top_p=1.5, top_k=-3, min_p=-0.5, repetition_penalty=-2, logprobs=-1
        )
    )
    assert read == SamplerParams()


@settings(max_examples=100, deadline=None)
@given(sent=limits)
def test_any_hello_survives_the_wire(sent: WorkerLimits) -> None:
    assert worker_codec.hello_from_proto(_wire(worker_codec.hello_to_proto(sent)).hello) == sent


def test_a_hello_with_every_field_set_round_trips_and_says_the_protocol_version() -> None:
    sent = WorkerLimits("w", 1000, 4, 2048, 1024, frozenset({0, 2}), "abc", "float32", "cpu", 64)
    wire = _wire(worker_codec.hello_to_proto(sent))
    assert wire.WhichOneof("msg") == "hello" and wire.hello.protocol_version == PROTOCOL_VERSION == 2
    assert worker_codec.hello_from_proto(wire.hello) == sent


def test_a_hello_without_a_page_size_means_pages_of_one() -> None:
    assert worker_codec.hello_from_proto(wk_pb.Hello(worker_id="w")).page_size == 1


@pytest.mark.parametrize(
    "event",
    [
        Welcome(True),
        Welcome(False, "fingerprint"),
        Welcome(False, "draining", retryable=True),
        Welcome(True, transfer_reports=True),
        Shutdown("done"),
        Move("rebalance"),
        Dropped("dropped by the control plane: no result for step 7 within 1.0 s"),
    ],
)
def test_welcome_shutdown_move_and_dropped_round_trip(event: Welcome | Shutdown | Move | Dropped) -> None:
    assert worker_codec.control_from_proto(_wire(worker_codec.control_to_proto(event))) == event


def test_an_empty_control_message_is_refused() -> None:
    with pytest.raises(ValueError, match="empty ControlMessage"):
        worker_codec.control_from_proto(wk_pb.ControlMessage())
    with pytest.raises(TypeError):
        worker_codec.control_to_proto(Drain("x"))  # type: ignore[arg-type]


def test_a_drain_goes_as_a_worker_message() -> None:
    drain = _wire(worker_codec.drain_to_proto(Drain("SIGTERM")))
    assert (drain.WhichOneof("msg"), drain.drain.reason) == ("drain", "SIGTERM")


def test_a_received_report_goes_as_a_worker_message_and_round_trips() -> None:
    outcome = TransferOutcome("w0/5f3a", "", 1 << 33)
    message = _wire(worker_codec.received_to_proto(outcome))
    assert message.WhichOneof("msg") == "received"
    assert worker_codec.received_from_proto(message.received) == outcome


@settings(max_examples=100, deadline=None)
@given(census=censuses)
def test_any_census_survives_the_wire(census: Census) -> None:
    assert worker_codec.census_from_proto(_wire(worker_codec.census_to_proto(census))) == census


def test_an_empty_census_reply_is_a_control_plane_that_accepts_nobody() -> None:
    assert worker_codec.census_from_proto(wk_pb.CensusReply()) == Census(accepting=False)
    assert worker_codec.census_request() == wk_pb.CensusRequest()


@settings(max_examples=50, deadline=None)
@given(sent=limits)
def test_a_census_request_carries_the_hello_it_asks_about(sent: WorkerLimits) -> None:
    hello = worker_codec.census_hello(_wire(worker_codec.census_request(sent)))
    assert hello is not None and worker_codec.hello_from_proto(hello) == sent
    assert worker_codec.census_hello(_wire(worker_codec.census_request())) is None


def test_only_a_judged_refusal_refuses() -> None:
    assert Census(hello_judged=True, refusal="page size").refuses()
    assert not Census(hello_judged=True).refuses()
    assert not Census(refusal="page size").refuses()  # nobody asked: nothing was judged


def test_a_census_with_negative_counts_reads_as_zero() -> None:
    """Defect (the worker's dialer kept them, so a peer's -5 workers would win every comparison)."""
    census = worker_codec.census_from_proto(wk_pb.CensusReply(workers=-5, queued=-1, running=-2))
    assert (census.workers, census.queued, census.running) == (0, 0, 0)


def test_sampled_count_and_handles_are_sampling_extends_then_decodes() -> None:
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
    assert sampled_count(plan) == 4
    assert_same(sampled_handles(plan), _i64(5, 7, 1, 2))


def test_a_decoded_plans_kind_follows_its_work() -> None:
    assert [StepKind.of(e, d) for e, d in [(1, 0), (0, 1), (1, 1), (0, 0)]] == [
        StepKind.PREFILL,
        StepKind.DECODE,
        StepKind.MIXED,
        StepKind.DECODE,
    ]


# --- the decode set as a delta (protos/decode_set.py) through one link's encoder and decoder ---------


def _decode_plan(
    step_id: int, members: list[int], slots: list[int], releases: tuple[int, ...] = ()
) -> StepPlan:
    return StepPlan(
        step_id,
        StepKind.DECODE,
        releases=_i64(*releases),
        decodes=DecodeWork(handles=_i64(*members), slots=_i64(*slots)),
    )


@st.composite
def decode_sessions(draw: st.DrawFn) -> list[StepPlan]:
    """Plans of one link: decode sets that lose and gain members, get reordered, released or reset,
    with plans without decode work between them, and slots that follow on, jump, or come in blocks."""
    plans: list[StepPlan] = []
    members: list[int] = []
    slot_of: dict[int, int] = {}
    # At most 14 steps of 6 new handles each: the last start stays within int64.
    next_handle = draw(st.sampled_from([1, 2**40, INT64_MAX - 128]))
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
    encoder, decoder, twin = (
        worker_codec.PlanEncoder(),
        worker_codec.PlanDecoder(),
        worker_codec.PlanEncoder(),
    )
    for plan in plans:
        wire = _wire(encoder.encode(plan)).plan
        # A twin fed private copies: an encoder that kept references to the plan's arrays would
        # diff the next plan against what the scheduler wrote into them since.
        assert twin.encode(_copied(plan)).plan == wire
        for worker_plan in (decoder.plan(wire), _alone(plan)):
            assert_same(worker_plan.decodes, plan.decodes)
        assert wire.decodes.count == len(plan.decodes)
        # The scheduler reuses its arrays: what the encoder kept must not change with them.
        plan.decodes.slots[:] = -7
        plan.decodes.handles[:] = 0


def _copied(plan: StepPlan) -> StepPlan:
    decodes = DecodeWork(plan.decodes.handles.copy(), plan.decodes.slots.copy())
    return dataclasses.replace(plan, decodes=decodes, releases=plan.releases.copy())


def test_a_steady_decode_plan_sends_only_what_changed() -> None:
    encoder, decoder = worker_codec.PlanEncoder(), worker_codec.PlanDecoder()
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
    encoder, decoder = worker_codec.PlanEncoder(), worker_codec.PlanDecoder()
    decoder.plan(_wire(encoder.encode(_decode_plan(1, [1, 2], [10, 20]))).plan)
    with pytest.raises(ValueError, match="handle 2 appears more than once"):
        encoder.encode(_decode_plan(2, [1, 2, 2], [11, 21, 22]))
    third = decoder.plan(_wire(encoder.encode(_decode_plan(3, [1, 2], [11, 21]))).plan)
    assert third.decodes.slots.tolist() == [11, 21]


def _steady_plans(running: int, page_size: int, steps: int = 4) -> list[StepPlan]:
    """Decode plans of `running` sequences, no churn. Page 1: the allocator hands out one contiguous
    block per step. Page 16: each sequence fills its own page; lengths are staggered, so every step
    1/16 of them start a new page (drawn at random)."""
    rng = np.random.default_rng(page_size)
    members = list(range(1000, 1000 + running))
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
        plans.append(_decode_plan(step + 1, members, slots.tolist()))
    return plans


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_steady_decode_plan_at_1024_running_fits_in_a_kilobyte(page_size: int) -> None:
    encoder, decoder = worker_codec.PlanEncoder(), worker_codec.PlanDecoder()
    sizes = []
    for plan in _steady_plans(1024, page_size):
        message = encoder.encode(plan)
        sizes.append(message.ByteSize())
        assert decoder.plan(_wire(message).plan).decodes.slots.tolist() == plan.decodes.slots.tolist()
    assert sizes[0] > 1024 * 2  # the first decode plan names every handle
    assert max(sizes[1:]) <= 1024, sizes


# --- plans the worker refuses to read ----------------------------------------------------------------


def _decoder_holding(members: list[int]) -> worker_codec.PlanDecoder:
    """A decoder whose decode set is `members`, at slots 100, 101, ..."""
    decoder = worker_codec.PlanDecoder()
    decoder.plan(
        worker_codec.plan_to_proto(_decode_plan(1, members, [100 + i for i in range(len(members))])).plan
    )
    return decoder


def _delta(count: int, **fields) -> wk_pb.StepPlan:  # type: ignore[no-untyped-def]
    return wk_pb.StepPlan(step_id=2, decodes=wk_pb.DecodeBatch(count=count, **fields))


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
    "decodes.joined: a handle is past 2": _delta(
        4, joined=[2**63], run_entries=[3], run_slots=[5], run_lens=[1]
    ),
    "decodes.left: a handle is past 2": _delta(2, left=[2**64 - 1]),
}


@pytest.mark.parametrize("message", list(BAD_DELTAS))
def test_a_bad_decode_delta_is_refused_naming_the_field(message: str) -> None:
    decoder = _decoder_holding([1, 2, 3])
    with pytest.raises(WireError, match=message):
        decoder.plan(_wire(BAD_DELTAS[message]))
    # The refused plan changed nothing: the set it diffs against is still [1, 2, 3].
    plan = decoder.plan(_wire(_delta(2, left=[2])))
    assert plan.decodes.handles.tolist() == [1, 3] and plan.decodes.slots.tolist() == [101, 103]


def test_a_released_handle_must_leave_the_decode_set() -> None:
    decoder = _decoder_holding([1, 2, 3])
    with pytest.raises(WireError, match="handle 2 is released by this plan but still in its decode set"):
        decoder.plan(_wire(wk_pb.StepPlan(step_id=2, release_handles=[2], decodes=_delta(3).decodes)))
    plan = decoder.plan(
        _wire(wk_pb.StepPlan(step_id=2, release_handles=[2], decodes=_delta(2, left=[2]).decodes))
    )
    assert plan.decodes.handles.tolist() == [1, 3]


def test_a_plan_read_on_its_own_must_not_release_a_handle_it_decodes() -> None:
    """Defect (the control side's reader, used by replay, let it through)."""
    full = wk_pb.DecodeBatch(count=1, full=[3], run_entries=[0], run_slots=[5], run_lens=[1])
    with pytest.raises(WireError, match="released by this plan"):
        worker_codec.plan_from_proto(wk_pb.StepPlan(step_id=1, release_handles=[3], decodes=full))


def test_a_plan_without_decodes_keeps_the_set_and_a_reset_empties_it() -> None:
    decoder = _decoder_holding([1, 2])
    assert len(decoder.plan(_wire(wk_pb.StepPlan(step_id=2))).decodes.handles) == 0
    assert decoder.plan(_wire(_delta(2))).decodes.slots.tolist() == [101, 102]
    reset = wk_pb.StepPlan(step_id=4, reset=True, decodes=_delta(2).decodes)
    with pytest.raises(WireError, match="the delta makes 0 entries, count says 2"):
        decoder.plan(_wire(reset))


BAD_ARRAYS = {
    "extends.token_ids: 6 bytes is not a whole number of 4-byte values": wk_pb.StepPlan(
        extends=wk_pb.ExtendBatch(token_ids=b"\x01" * 6)
    ),
    "extends.slots: value -2 at index 1 is negative": wk_pb.StepPlan(
        extends=wk_pb.ExtendBatch(slots=np.array([3, -2], "<i8").tobytes())
    ),
    "new_seqs.prefix_slots: 7 bytes": wk_pb.StepPlan(
        new_seqs=[wk_pb.NewSequence(handle=1, prefix_slots=b"\x00" * 7)]
    ),
    "offloads.slots": wk_pb.StepPlan(offloads=[wk_pb.KvTransfer(handle=1, slots=b"\x00" * 9)]),
    "remaps.slots": wk_pb.StepPlan(remaps=[wk_pb.SlotRemap(handle=1, slots=b"\xff" * 8)]),
}


@pytest.mark.parametrize("message", list(BAD_ARRAYS))
def test_a_malformed_array_is_refused_naming_it(message: str) -> None:
    with pytest.raises(WireError, match=message):
        worker_codec.control_from_proto(wk_pb.ControlMessage(plan=_wire(BAD_ARRAYS[message])))


PAST_INT64 = 2**63
HANDLES_PAST_INT64 = {
    "release_handles": wk_pb.StepPlan(release_handles=[PAST_INT64]),
    "extends.handles": wk_pb.StepPlan(extends=wk_pb.ExtendBatch(handles=[2**64 - 1], starts=[0], lens=[1])),
    "new_seqs": wk_pb.StepPlan(new_seqs=[wk_pb.NewSequence(handle=PAST_INT64)]),
    "offloads": wk_pb.StepPlan(offloads=[wk_pb.KvTransfer(handle=PAST_INT64)]),
    "restores": wk_pb.StepPlan(restores=[wk_pb.KvTransfer(handle=PAST_INT64)]),
    "remaps": wk_pb.StepPlan(remaps=[wk_pb.SlotRemap(handle=PAST_INT64)]),
    "decodes.full": _delta(1, full=[2**64 - 1], run_entries=[0], run_slots=[5], run_lens=[1]),
}


@pytest.mark.parametrize("name", list(HANDLES_PAST_INT64))
def test_a_handle_past_int64_is_refused_not_wrapped(name: str) -> None:
    """Defect (the control side's reader turned a recorded handle of 2^64 - 1 into -1). Handles are
    uint64 on the wire, int64 in both planes: the control plane never hands out one past 2^63 - 1."""
    with pytest.raises(WireError, match=f"{name}: .*handle .*past 2\\^63 - 1"):
        worker_codec.plan_from_proto(_wire(HANDLES_PAST_INT64[name]))


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
    batch = wk_pb.DecodeBatch(
        count=count, full=full, left=left, joined=joined, run_entries=entries, run_slots=slots, run_lens=lens
    )
    try:
        plan = decoder.plan(_wire(wk_pb.StepPlan(step_id=2, decodes=batch)))
    except ValueError:
        return
    members, decoded_slots = plan.decodes.handles, plan.decodes.slots
    assert len(members) == max(count, 0) == len(decoded_slots)
    assert len(set(members.tolist())) == len(members)
    assert all(s >= 0 for s in decoded_slots.tolist())


# --- results the control plane refuses -----------------------------------------------------------------


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
