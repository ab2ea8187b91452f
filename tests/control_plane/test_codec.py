"""Round trips through control_plane.codec, and client-input validation naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from control_plane import codec
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
from protos.stepwise.v1 import generation_pb2 as gen_pb


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
    _assert_same(codec.plan_from_proto(codec.plan_to_proto(plan).plan), plan)


def test_result_round_trip() -> None:
    result = StepResult(
        step_id=3,
        handles=_i64(1, 2),
        token_ids=np.asarray([9, 8], np.int32),
        # One entry per sampled token (the sampler's contract when any row asks for logprobs).
        logprobs=(TokenLogprobs(-0.5, (1, 2), (-0.5, -1.0)), TokenLogprobs(-0.25)),
        kv=KvReport(live_seqs=2, seq_slots=10, capacity_tokens=100, device_mem_used_bytes=5, host_seqs=1),
        forward_s=0.25,
        error="",
    )
    _assert_same(codec.result_from_proto(codec.result_to_proto(result).result), result)


def test_hello_round_trip() -> None:
    limits = WorkerLimits("w", 1000, 4, 2048, 1024, frozenset({0, 2}), "abc", "float32", "cpu", 64)
    assert codec.limits_from_hello(codec.hello_from_limits(limits)) == limits


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
    with pytest.raises(codec.InvalidArgument, match=field.replace(".", r"\.")):
        codec.generate_input_from_proto(gen_pb.GenerateRequest(text="hi", sampling=sampling))


def test_prompt_is_required_and_non_empty() -> None:
    with pytest.raises(codec.InvalidArgument, match="prompt"):
        codec.generate_input_from_proto(gen_pb.GenerateRequest())
    with pytest.raises(codec.InvalidArgument, match="text"):
        codec.generate_input_from_proto(gen_pb.GenerateRequest(text=""))


def test_unknown_token_id_names_index() -> None:
    with pytest.raises(codec.InvalidArgument, match="index 1"):
        codec.check_token_ids([1, 5000], vocab_size=1024)


def test_defaults_when_unset() -> None:
    inp = codec.generate_input_from_proto(gen_pb.GenerateRequest(text="hi"))
    assert inp.params.max_new_tokens is None
    assert inp.params.sampler == SamplerSpec()
    assert inp.params.priority is None
