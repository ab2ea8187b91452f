"""Client-input validation naming the field (control_plane/frontend/client_codec.py), a recording in an older
format, and the control plane's end of a worker link (control_plane/core/worker_link.py) over a
stand-in stream. The worker protocol's codec is tests/protos/test_worker_codec.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from control_plane.config import SchedulerConfig
from control_plane.core.handover import WorkerGone
from control_plane.core.worker_checks import WorkerFault
from control_plane.core.worker_link import StreamChannel
from control_plane.frontend import client_codec
from control_plane.record import codec as record_codec
from control_plane.record.entries import Header
from control_plane.record.files import varint
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.worker import (
    DecodeWork,
    SamplerParams,
    StepKind,
    StepPlan,
    WorkerLimits,
)
from stepwise import replay


def _i64(*v: int) -> np.ndarray:
    return np.asarray(v, dtype=np.int64)


def _decode_plan(step_id: int, handles: list[int], slots: list[int]) -> StepPlan:
    return StepPlan(step_id, StepKind.DECODE, decodes=DecodeWork(handles=_i64(*handles), slots=_i64(*slots)))


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
        (gen_pb.SamplingParams(logit_bias={-1: 1.0}), "sampling.logit_bias"),
        (gen_pb.SamplingParams(logit_bias={3: 100.5}), "sampling.logit_bias"),
        (gen_pb.SamplingParams(logit_bias={3: float("nan")}), "sampling.logit_bias"),
        (gen_pb.SamplingParams(logit_bias=dict.fromkeys(range(1025), 1.0)), "sampling.logit_bias"),
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


def test_logit_bias_reaches_the_sampler_sorted_and_its_ids_are_checked_against_the_vocabulary() -> None:
    sampling = gen_pb.SamplingParams(logit_bias={7: -100.0, 2: 3.5})
    inp = client_codec.generate_input_from_proto(gen_pb.GenerateRequest(text="hi", sampling=sampling))
    assert inp.params.sampler.logit_bias == ((2, 3.5), (7, -100.0))
    client_codec.check_logit_bias_ids(inp.params, vocab_size=8)
    with pytest.raises(client_codec.InvalidArgument, match=r"sampling\.logit_bias: token id 7 is outside"):
        client_codec.check_logit_bias_ids(inp.params, vocab_size=7)


def test_unknown_token_id_names_index() -> None:
    with pytest.raises(client_codec.InvalidArgument, match="index 1"):
        client_codec.check_token_ids([1, 5000], vocab_size=1024)


def test_defaults_when_unset() -> None:
    inp = client_codec.generate_input_from_proto(gen_pb.GenerateRequest(text="hi"))
    assert inp.params.max_new_tokens is None
    # The client protocol's temperature is 1.0 when unset, not SamplerParams' greedy default.
    assert inp.params.sampler == SamplerParams(temperature=1.0)
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
