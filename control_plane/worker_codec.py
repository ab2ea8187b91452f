"""The worker protocol (worker.proto) at the control plane's edge: hellos, plans and results
converted between wire messages and the scheduler's typed values."""

from __future__ import annotations

import math

import numpy as np

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
from protos import decode_set
from protos.arrays import INT32, INT64, WireError, pack, unpack
from protos.stepwise.v1 import worker_pb2 as wk_pb

PROTOCOL_VERSION = 2


class ProtocolError(ValueError):
    """A worker's message that breaks the protocol; the message says how. The worker is at fault."""


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
