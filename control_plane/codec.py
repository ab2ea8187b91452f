"""The only control-plane module that imports the generated protobuf stubs.

Conversions between wire messages and the control plane's typed values, and validation of client
input with messages that name the offending field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from control_plane.config import Limits
from control_plane.request import FinishKind, FinishReason, RequestParams, SamplerSpec
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
from protos import decode_set
from protos.arrays import INT32, INT64, WireError, pack, unpack
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import worker_pb2 as wk_pb

PROTOCOL_VERSION = 2
MAX_SAMPLES = 64


class InvalidArgument(ValueError):
    """Client input that is refused; the message names the field."""


class ProtocolError(ValueError):
    """A worker's message that breaks the protocol; the message says how. The worker is at fault."""


# --- worker link -------------------------------------------------------------------------------


def limits_from_hello(hello: wk_pb.Hello) -> WorkerLimits:
    return WorkerLimits(
        worker_id=hello.worker_id,
        kv_capacity_tokens=hello.kv_capacity_tokens,
        page_size=hello.page_size or 1,
        max_context=hello.max_context,
        vocab_size=hello.vocab_size,
        eos_token_ids=frozenset(hello.eos_token_ids),
        model_fingerprint=hello.model_fingerprint,
        dtype=hello.dtype,
        device=hello.device,
        host_pool_capacity_tokens=hello.host_pool_capacity_tokens,
    )


def hello_from_limits(limits: WorkerLimits) -> wk_pb.Hello:
    """Inverse of limits_from_hello (used by tests and tools that speak for a worker)."""
    return wk_pb.Hello(
        worker_id=limits.worker_id,
        model_fingerprint=limits.model_fingerprint,
        kv_capacity_tokens=limits.kv_capacity_tokens,
        page_size=limits.page_size,
        max_context=limits.max_context,
        vocab_size=limits.vocab_size,
        dtype=limits.dtype,
        device=limits.device,
        protocol_version=PROTOCOL_VERSION,
        eos_token_ids=sorted(limits.eos_token_ids),
        host_pool_capacity_tokens=limits.host_pool_capacity_tokens,
    )


def welcome(accepted: bool, reason: str = "", retryable: bool = False) -> wk_pb.ControlMessage:
    welcome = wk_pb.Welcome(accepted=accepted, reason=reason, retryable=retryable)
    return wk_pb.ControlMessage(welcome=welcome)


def shutdown(reason: str) -> wk_pb.ControlMessage:
    return wk_pb.ControlMessage(shutdown=wk_pb.Shutdown(reason=reason))


def move(reason: str) -> wk_pb.ControlMessage:
    return wk_pb.ControlMessage(move=wk_pb.Move(reason=reason))


def sampler_to_proto(spec: SamplerSpec) -> wk_pb.SamplerParams:
    return wk_pb.SamplerParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        repetition_penalty=spec.repetition_penalty,
        frequency_penalty=spec.frequency_penalty,
        presence_penalty=spec.presence_penalty,
        has_seed=spec.seed is not None,
        seed=spec.seed or 0,
        logprobs=spec.logprobs,
    )


def sampler_from_proto(msg: wk_pb.SamplerParams) -> SamplerSpec:
    return SamplerSpec(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty,
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        seed=msg.seed if msg.has_seed else None,
        logprobs=msg.logprobs,
    )


# --- plans ---------------------------------------------------------------------------------------


class PlanEncoder:
    """Encodes the plans of one worker link, the decode set as a delta against the last decode plan.

    One per link, fed every plan in the order it is sent (the worker's PlanDecoder mirrors it). A plan
    with `reset` starts from an empty decode set, as the worker does. The encoder's state changes
    only once a plan is wholly encoded; an exception (a bug of ours, e.g. a handle decoded twice)
    leaves it as it was.
    """

    def __init__(self) -> None:
        self._decodes = decode_set.EMPTY
        # Handles released or offloaded since the last decode plan: the likely leavers of the set.
        self._leaving: list[np.ndarray] = []

    def encode(self, plan: StepPlan) -> wk_pb.ControlMessage:
        prev, leaving = (decode_set.EMPTY, []) if plan.reset else (self._decodes, self._leaving)
        leaving = [*leaving, plan.releases, _handles_of(plan.offloads)]
        message, decodes = _encode_plan(plan, prev, np.concatenate(leaving))
        self._decodes, self._leaving = decodes, [] if len(plan.decodes) else leaving
        return message


def plan_to_proto(plan: StepPlan) -> wk_pb.ControlMessage:
    """A plan on its own, its decode set in full (recordings, tests, `step_through_wire`)."""
    message, _ = _encode_plan(plan, decode_set.EMPTY, None)
    return message


def _handles_of(transfers: tuple[KvTransfer, ...]) -> np.ndarray:
    return np.fromiter((t.handle for t in transfers), dtype=np.int64, count=len(transfers))


def _encode_plan(
    plan: StepPlan, prev: decode_set.DecodeSet, leaving: np.ndarray | None
) -> tuple[wk_pb.ControlMessage, decode_set.DecodeSet]:
    """The message (a delta against `prev` unless `leaving` is None), and the decode set to diff the
    next plan against. Filled in place: a nested constructor would copy each sub-message."""
    dec = plan.decodes
    delta, decodes = decode_set.encode(prev, dec.handles, dec.slots, leaving, allow_delta=leaving is not None)
    message = wk_pb.ControlMessage()
    msg = message.plan
    msg.step_id, msg.reset = plan.step_id, plan.reset
    if len(plan.releases):
        msg.release_handles.extend(plan.releases.tolist())
    for t in plan.offloads:
        msg.offloads.add(handle=t.handle, slots=pack(t.slots, INT64))
    for t in plan.restores:
        msg.restores.add(handle=t.handle, slots=pack(t.slots, INT64))
    for s in plan.new_seqs:
        _fill_new_seq(msg.new_seqs.add(), s)
    if len(plan.extends):
        _fill_extends(msg.extends, plan.extends)
    if delta.count:
        decode_set.fill(msg.decodes, delta)
    for r in plan.remaps:
        msg.remaps.add(handle=r.handle, start=r.start, slots=pack(r.slots, INT64))
    return message, decodes


def _fill_new_seq(msg: wk_pb.NewSequence, s: NewSeq) -> None:
    msg.handle = s.handle
    msg.sampler.CopyFrom(sampler_to_proto(s.sampler))
    msg.prefix_slots = pack(s.prefix_slots, INT64)
    msg.history_ids.extend(s.history_ids.tolist())
    msg.request_id, msg.prompt_len, msg.sim_output_len = s.request_id, s.prompt_len, s.sim_output_len


def _fill_extends(msg: wk_pb.ExtendBatch, ext: ExtendWork) -> None:
    msg.handles.extend(ext.handles.tolist())
    msg.starts.extend(ext.starts.tolist())
    msg.lens.extend(ext.lens.tolist())
    msg.sample.extend(ext.sample.tolist())
    msg.token_ids = pack(ext.token_ids, INT32)
    msg.slots = pack(ext.slots, INT64)


def plan_from_proto(msg: wk_pb.StepPlan) -> StepPlan:
    """Inverse of plan_to_proto (the plan's kind is not on the wire; it is derived). A plan read on
    its own must carry its decode set in full; WireError (a ValueError) names what is wrong."""
    ext = msg.extends
    extends = ExtendWork(
        handles=np.array(ext.handles, dtype=np.int64),
        starts=np.array(ext.starts, dtype=np.int32),
        lens=np.array(ext.lens, dtype=np.int32),
        sample=np.array(ext.sample, dtype=bool),
        token_ids=unpack(ext.token_ids, INT32, "extends.token_ids", np.int32),
        slots=unpack(ext.slots, INT64, "extends.slots"),
    )
    decoded = decode_set.decode(decode_set.EMPTY, decode_set.from_proto(msg.decodes))
    decodes = DecodeWork()
    if decoded is not None:
        decodes = DecodeWork(handles=decoded.handles.astype(np.int64), slots=decoded.slots)
    if len(extends) and len(decodes):
        derived = StepKind.MIXED
    else:
        derived = StepKind.PREFILL if len(extends) else StepKind.DECODE
    return StepPlan(
        step_id=msg.step_id,
        kind=derived,
        reset=msg.reset,
        releases=np.array(msg.release_handles, dtype=np.int64),
        offloads=tuple(KvTransfer(t.handle, unpack(t.slots, INT64, "offloads.slots")) for t in msg.offloads),
        restores=tuple(KvTransfer(t.handle, unpack(t.slots, INT64, "restores.slots")) for t in msg.restores),
        new_seqs=tuple(_new_seq_from_proto(s) for s in msg.new_seqs),
        extends=extends,
        decodes=decodes,
        remaps=tuple(
            SlotRemap(r.handle, r.start, unpack(r.slots, INT64, "remaps.slots")) for r in msg.remaps
        ),
    )


def _new_seq_from_proto(s: wk_pb.NewSequence) -> NewSeq:
    return NewSeq(
        handle=s.handle,
        sampler=sampler_from_proto(s.sampler),
        prefix_slots=unpack(s.prefix_slots, INT64, "new_seqs.prefix_slots"),
        history_ids=np.array(s.history_ids, dtype=np.int32),
        request_id=s.request_id,
        prompt_len=s.prompt_len,
        sim_output_len=s.sim_output_len,
    )


def sampled_count(plan: StepPlan) -> int:
    """Tokens the plan's result must carry: one per extend with `sample` set, one per decode."""
    return int(np.count_nonzero(plan.extends.sample)) + len(plan.decodes)


# --- results -------------------------------------------------------------------------------------


def result_from_proto(msg: wk_pb.StepResult, sampled: int | None = None) -> StepResult:
    """Decode a worker's result; ProtocolError when it cannot be one, or (given `sampled`, what the
    plan sampled) when its token count differs. An error result carries no tokens. Step id and
    vocabulary are check_result's."""
    try:
        tokens = unpack(msg.token_ids, INT32, "token_ids", np.int32)
    except WireError as exc:
        raise ProtocolError(f"result for step {msg.step_id}: {exc}") from None
    if sampled is not None and not msg.error and len(tokens) != sampled:
        raise ProtocolError(
            f"result for step {msg.step_id} has {len(tokens)} tokens; the plan sampled {sampled}"
        )
    if msg.logprobs and len(msg.logprobs) != len(tokens):
        raise ProtocolError(f"result has {len(msg.logprobs)} logprobs for {len(tokens)} tokens")
    for name in ("forward_s", "wait_s"):
        seconds = getattr(msg, name)
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ProtocolError(f"result for step {msg.step_id}: {name} {seconds} is not a duration")
    return _decode_result(msg, tokens)


def _decode_result(msg: wk_pb.StepResult, tokens: np.ndarray) -> StepResult:
    kv = msg.kv
    return StepResult(
        step_id=msg.step_id,
        token_ids=tokens,
        logprobs=tuple(
            TokenLogprobs(lp.logprob, tuple(lp.top_ids), tuple(lp.top_logprobs)) for lp in msg.logprobs
        ),
        kv=KvReport(
            live_seqs=kv.live_seqs,
            seq_slots=kv.seq_slots,
            capacity_tokens=kv.capacity_tokens,
            device_mem_used_bytes=kv.device_mem_used_bytes,
            host_seqs=kv.host_seqs,
        ),
        forward_s=msg.forward_s,
        wait_s=msg.wait_s,
        error=msg.error,
    )


def result_to_proto(result: StepResult) -> wk_pb.WorkerMessage:
    """Inverse of result_from_proto (recordings, tests and tools that speak for a worker)."""
    kv = result.kv
    msg = wk_pb.StepResult(
        step_id=result.step_id,
        token_ids=pack(result.token_ids, INT32),
        logprobs=[
            wk_pb.TokenLogprobs(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
            for lp in result.logprobs
        ],
        kv=wk_pb.KvReport(
            live_seqs=kv.live_seqs,
            seq_slots=kv.seq_slots,
            capacity_tokens=kv.capacity_tokens,
            device_mem_used_bytes=kv.device_mem_used_bytes,
            host_seqs=kv.host_seqs,
        ),
        forward_s=result.forward_s,
        wait_s=result.wait_s,
        error=result.error,
    )
    return wk_pb.WorkerMessage(result=msg)


# --- client API --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """A validated Generate call: exactly one of text / input_ids is set."""

    request_id: str
    text: str | None
    input_ids: tuple[int, ...] | None
    params: RequestParams
    n: int = 1


def _opt(msg: object, name: str, default: object) -> object:
    return getattr(msg, name) if msg.HasField(name) else default  # type: ignore[attr-defined]


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidArgument(f"{field_name}: {message}")


def _check_finite(msg: gen_pb.SamplingParams) -> None:
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    ):
        value = getattr(msg, name)
        _check(math.isfinite(value), f"sampling.{name}", f"must be a finite number, got {value}")


def _check_stops(msg: gen_pb.SamplingParams, limits: Limits) -> None:
    count, chars = len(msg.stop), sum(len(s) for s in msg.stop)
    _check(
        count <= limits.max_stop_strings,
        "sampling.stop",
        f"{count} stop strings; at most {limits.max_stop_strings} are allowed (--max-stop-strings)",
    )
    _check(
        chars <= limits.max_stop_chars,
        "sampling.stop",
        f"{chars} characters of stop strings; at most {limits.max_stop_chars} (--max-stop-chars)",
    )
    _check(all(s for s in msg.stop), "sampling.stop", "stop strings must not be empty")
    ids = len(msg.stop_token_ids)
    _check(
        ids <= limits.max_stop_token_ids,
        "sampling.stop_token_ids",
        f"{ids} ids; at most {limits.max_stop_token_ids} are allowed (--max-stop-token-ids)",
    )


def sampling_from_proto(msg: gen_pb.SamplingParams, limits: Limits | None = None) -> RequestParams:
    """Validate and convert sampling parameters; raises InvalidArgument naming the field."""
    _check_finite(msg)
    _check_stops(msg, limits or Limits())
    max_new = msg.max_new_tokens if msg.HasField("max_new_tokens") else None
    temperature = float(_opt(msg, "temperature", 1.0))  # type: ignore[arg-type]
    top_p = float(_opt(msg, "top_p", 1.0))  # type: ignore[arg-type]
    top_k = int(_opt(msg, "top_k", 0))  # type: ignore[call-overload]
    min_p = float(_opt(msg, "min_p", 0.0))  # type: ignore[arg-type]
    rep = float(_opt(msg, "repetition_penalty", 1.0))  # type: ignore[arg-type]
    _check(max_new is None or max_new >= 0, "sampling.max_new_tokens", f"must be >= 0, got {max_new}")
    min_new = msg.min_new_tokens if msg.HasField("min_new_tokens") else 0
    _check(min_new >= 0, "sampling.min_new_tokens", f"must be >= 0, got {min_new}")
    _check(temperature >= 0.0, "sampling.temperature", f"must be >= 0, got {temperature}")
    _check(0.0 < top_p <= 1.0, "sampling.top_p", f"must be in (0, 1], got {top_p}")
    _check(top_k >= 0, "sampling.top_k", f"must be >= 0, got {top_k}")
    _check(0.0 <= min_p <= 1.0, "sampling.min_p", f"must be in [0, 1], got {min_p}")
    _check(rep > 0.0, "sampling.repetition_penalty", f"must be > 0, got {rep}")
    n = msg.n if msg.HasField("n") else 1
    _check(1 <= n <= MAX_SAMPLES, "sampling.n", f"must be in [1, {MAX_SAMPLES}], got {n}")
    _check(all(t >= 0 for t in msg.stop_token_ids), "sampling.stop_token_ids", "token ids must be >= 0")
    sampler = SamplerSpec(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=rep,
        frequency_penalty=msg.frequency_penalty if msg.HasField("frequency_penalty") else 0.0,
        presence_penalty=msg.presence_penalty if msg.HasField("presence_penalty") else 0.0,
        seed=msg.seed if msg.HasField("seed") else None,
    )
    return RequestParams(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        stop=tuple(msg.stop),
        stop_token_ids=frozenset(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        sampler=sampler,
    )


def request_params_from_proto(
    sampling: gen_pb.SamplingParams, priority: int | None, routing_key: str, limits: Limits | None = None
) -> RequestParams:
    """A request's parameters: its checked sampling parameters, priority and routing key."""
    params = sampling_from_proto(sampling, limits)
    return dataclasses.replace(params, priority=priority, routing_key=routing_key)


def generate_input_from_proto(msg: gen_pb.GenerateRequest, limits: Limits | None = None) -> GenerateInput:
    """Validate a Generate call (all but what needs the tokenizer or a worker); InvalidArgument."""
    limits = limits or Limits()
    which = msg.WhichOneof("prompt")
    _check(which is not None, "prompt", "one of text or input_ids is required")
    text = msg.text if which == "text" else None
    ids = tuple(msg.input_ids.ids) if which == "input_ids" else None
    _check(bool(text) or bool(ids), "text" if which == "text" else "input_ids", "prompt must not be empty")
    if text is not None:
        size = len(text.encode("utf-8", "surrogatepass"))
        _check(
            size <= limits.max_prompt_bytes,
            "text",
            f"prompt of {size} bytes; at most {limits.max_prompt_bytes} are allowed (--max-prompt-bytes)",
        )
    for name in ("request_id", "routing_key"):
        value = getattr(msg, name)
        _check(
            len(value) <= limits.max_id_chars,
            name,
            f"{len(value)} characters; at most {limits.max_id_chars} are allowed",
        )
    priority = msg.priority if msg.HasField("priority") else None
    params = request_params_from_proto(msg.sampling, priority, msg.routing_key, limits)
    n = msg.sampling.n if msg.sampling.HasField("n") else 1
    return GenerateInput(request_id=msg.request_id, text=text, input_ids=ids, params=params, n=n)


def check_token_ids(ids: tuple[int, ...] | list[int], vocab_size: int) -> None:
    if not ids:
        return
    array = np.asarray(ids, dtype=np.int64)
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if len(bad):
        i = int(bad[0])
        raise InvalidArgument(
            f"input_ids: token id {ids[i]} at index {i} is outside the vocabulary [0, {vocab_size})"
        )


# --- requests that do not parse --------------------------------------------------------------------


def _bytes_twin(file: object) -> descriptor_pool.DescriptorPool:
    """A copy of a .proto file's messages with every string field as bytes, in a pool of its own.

    A field declared `string` must hold UTF-8, and protobuf refuses the whole message otherwise
    without saying which field; the twin parses the same bytes and lets us find it.
    """
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)  # type: ignore[attr-defined]
    proto.name = "bytes_twin/" + proto.name
    for message in proto.message_type:
        for fld in message.field:
            if fld.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                fld.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return pool


_TWIN_POOL = _bytes_twin(gen_pb.DESCRIPTOR)


@dataclass(frozen=True, slots=True)
class Unparsable:
    """A request that did not parse (e.g. a string field that is not UTF-8), and why."""

    reason: str


def lenient_parser(message: type[Message]) -> Callable[[bytes], Message | Unparsable]:
    """A request deserializer that turns a parse failure into an Unparsable, for the handler to
    refuse with INVALID_ARGUMENT naming the field (gRPC itself would answer UNKNOWN)."""

    def parse(data: bytes) -> Message | Unparsable:
        try:
            return message.FromString(data)
        except DecodeError:
            return Unparsable(describe_unparsable(data, message.DESCRIPTOR.full_name))

    return parse


def describe_unparsable(data: bytes, message_name: str = "stepwise.v1.GenerateRequest") -> str:
    """Why `data` is not a valid message: the first string field that is not UTF-8, by its path."""
    twin = message_factory.GetMessageClass(_TWIN_POOL.FindMessageTypeByName(message_name))()
    try:
        twin.ParseFromString(data)
    except DecodeError:
        return "the request is not a valid protobuf message"
    path = _first_bad_utf8(twin, "")
    if path is None:
        return "the request is not a valid protobuf message"
    return f"{path}: not valid UTF-8"


def _first_bad_utf8(msg: Message, prefix: str) -> str | None:
    original = gen_pb.DESCRIPTOR.message_types_by_name[msg.DESCRIPTOR.name]
    strings = {f.name for f in original.fields if f.type == f.TYPE_STRING}
    for fld, value in msg.ListFields():
        items = list(enumerate(value)) if fld.is_repeated else [(None, value)]
        for i, item in items:
            where = prefix + fld.name + ("" if i is None else f"[{i}]")
            if isinstance(item, Message):
                found = _first_bad_utf8(item, where + ".")
                if found:
                    return found
            elif fld.name in strings and not _is_utf8(item):
                return where
    return None


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


_FINISH_TO_PROTO = {
    FinishKind.STOP: gen_pb.FINISH_REASON_STOP,
    FinishKind.LENGTH: gen_pb.FINISH_REASON_LENGTH,
    FinishKind.ABORT: gen_pb.FINISH_REASON_ABORT,
}


def chunk_response(request_id: str, index: int, token_ids: list[int], text: str) -> gen_pb.GenerateResponse:
    chunk = gen_pb.TokenChunk(index=index, token_ids=token_ids, text=text)
    return gen_pb.GenerateResponse(request_id=request_id, chunk=chunk)


def finished_response(
    request_id: str,
    index: int,
    reason: FinishReason,
    usage: tuple[int, int, int],
    timings: tuple[float, float, float],
) -> gen_pb.GenerateResponse:
    prompt, cached, completion = usage
    queue_s, ttft_s, total_s = timings
    return gen_pb.GenerateResponse(
        request_id=request_id,
        finished=gen_pb.Finished(
            index=index,
            reason=_FINISH_TO_PROTO[reason.kind],
            message=reason.message,
            usage=gen_pb.Usage(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion),
            timings=gen_pb.Timings(queue_s=queue_s, ttft_s=ttft_s, total_s=total_s),
        ),
    )
