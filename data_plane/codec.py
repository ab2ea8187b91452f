"""Protobuf <-> data_plane.messages. The only data_plane module that imports the generated stubs.

Normalisation on the way in: proto3 cannot tell "unset" from zero, so top_p <= 0 and
repetition_penalty <= 0 mean "off" (1.0), and has_seed=false means no seed.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from data_plane.messages import (
    ControlEvent,
    DecodeBatch,
    ExtendBatch,
    Hello,
    KvReport,
    KvTransfer,
    NewSequence,
    SamplerParams,
    Shutdown,
    SlotRemap,
    StepPlan,
    StepResult,
    TokenLogprobs,
    Welcome,
)
from protos.stepwise.v1 import worker_pb2


def _array(values: Iterable[int] | Iterable[bool], dtype: type) -> np.ndarray:
    return np.fromiter(values, dtype=dtype)


# ---- control -> worker -------------------------------------------------------------------------


def control_from_proto(msg: worker_pb2.ControlMessage) -> ControlEvent:
    """Decode one ControlMessage; ValueError if it carries nothing."""
    kind = msg.WhichOneof("msg")
    if kind == "welcome":
        return Welcome(accepted=msg.welcome.accepted, reason=msg.welcome.reason)
    if kind == "plan":
        return plan_from_proto(msg.plan)
    if kind == "shutdown":
        return Shutdown(reason=msg.shutdown.reason)
    raise ValueError("empty ControlMessage")


def sampler_from_proto(p: worker_pb2.SamplerParams) -> SamplerParams:
    return SamplerParams(
        temperature=max(0.0, p.temperature),
        top_p=p.top_p if 0.0 < p.top_p < 1.0 else 1.0,
        top_k=max(0, p.top_k),
        min_p=max(0.0, p.min_p),
        repetition_penalty=p.repetition_penalty if p.repetition_penalty > 0.0 else 1.0,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        seed=p.seed if p.has_seed else None,
        logprobs=max(0, p.logprobs),
    )


def plan_from_proto(p: worker_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=p.step_id,
        release_handles=_array(p.release_handles, np.uint64),
        reset=p.reset,
        offloads=tuple(KvTransfer(t.handle, _array(t.slots, np.int64)) for t in p.offloads),
        restores=tuple(KvTransfer(t.handle, _array(t.slots, np.int64)) for t in p.restores),
        new_seqs=tuple(_new_seq_from_proto(s) for s in p.new_seqs),
        extends=ExtendBatch(
            handles=_array(p.extends.handles, np.uint64),
            starts=_array(p.extends.starts, np.int64),
            lens=_array(p.extends.lens, np.int64),
            sample=_array(p.extends.sample, np.bool_),
            token_ids=_array(p.extends.token_ids, np.int64),
            slots=_array(p.extends.slots, np.int64),
        ),
        decodes=DecodeBatch(
            handles=_array(p.decodes.handles, np.uint64),
            slots=_array(p.decodes.slots, np.int64),
        ),
        remaps=tuple(SlotRemap(r.handle, r.start, _array(r.slots, np.int64)) for r in p.remaps),
    )


def _new_seq_from_proto(s: worker_pb2.NewSequence) -> NewSequence:
    return NewSequence(
        handle=s.handle,
        sampler=sampler_from_proto(s.sampler),
        prefix_slots=_array(s.prefix_slots, np.int64),
        history_ids=_array(s.history_ids, np.int64),
        request_id=s.request_id,
        sim_output_len=s.sim_output_len,
        prompt_len=s.prompt_len,
    )


def sampler_to_proto(s: SamplerParams) -> worker_pb2.SamplerParams:
    return worker_pb2.SamplerParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        has_seed=s.seed is not None,
        seed=s.seed or 0,
        logprobs=s.logprobs,
    )


def plan_to_proto(plan: StepPlan) -> worker_pb2.StepPlan:
    """The inverse of plan_from_proto (used by tests and fake control planes)."""
    e, d = plan.extends, plan.decodes
    return worker_pb2.StepPlan(
        step_id=plan.step_id,
        reset=plan.reset,
        release_handles=plan.release_handles.tolist(),
        offloads=[worker_pb2.KvTransfer(handle=t.handle, slots=t.slots.tolist()) for t in plan.offloads],
        restores=[worker_pb2.KvTransfer(handle=t.handle, slots=t.slots.tolist()) for t in plan.restores],
        new_seqs=[
            worker_pb2.NewSequence(
                handle=s.handle,
                sampler=sampler_to_proto(s.sampler),
                prefix_slots=s.prefix_slots.tolist(),
                history_ids=s.history_ids.tolist(),
                request_id=s.request_id,
                sim_output_len=s.sim_output_len,
                prompt_len=s.prompt_len,
            )
            for s in plan.new_seqs
        ],
        extends=worker_pb2.ExtendBatch(
            handles=e.handles.tolist(),
            starts=e.starts.tolist(),
            lens=e.lens.tolist(),
            sample=e.sample.tolist(),
            token_ids=e.token_ids.tolist(),
            slots=e.slots.tolist(),
        ),
        decodes=worker_pb2.DecodeBatch(handles=d.handles.tolist(), slots=d.slots.tolist()),
        remaps=[
            worker_pb2.SlotRemap(handle=r.handle, start=r.start, slots=r.slots.tolist()) for r in plan.remaps
        ],
    )


# ---- worker -> control -------------------------------------------------------------------------


def hello_to_proto(h: Hello) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(
        hello=worker_pb2.Hello(
            worker_id=h.worker_id,
            model_fingerprint=h.model_fingerprint,
            kv_capacity_tokens=h.kv_capacity_tokens,
            page_size=h.page_size,
            max_context=h.max_context,
            vocab_size=h.vocab_size,
            dtype=h.dtype,
            device=h.device,
            protocol_version=h.protocol_version,
            eos_token_ids=list(h.eos_token_ids),
            host_pool_capacity_tokens=h.host_pool_capacity_tokens,
        )
    )


def hello_from_proto(h: worker_pb2.Hello) -> Hello:
    return Hello(
        worker_id=h.worker_id,
        model_fingerprint=h.model_fingerprint,
        kv_capacity_tokens=h.kv_capacity_tokens,
        page_size=h.page_size,
        max_context=h.max_context,
        vocab_size=h.vocab_size,
        dtype=h.dtype,
        device=h.device,
        eos_token_ids=tuple(h.eos_token_ids),
        host_pool_capacity_tokens=h.host_pool_capacity_tokens,
        protocol_version=h.protocol_version,
    )


def result_to_proto(r: StepResult) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(
        result=worker_pb2.StepResult(
            step_id=r.step_id,
            handles=r.handles.tolist(),
            token_ids=r.token_ids.tolist(),
            logprobs=[
                worker_pb2.TokenLogprobs(
                    logprob=lp.logprob, top_ids=list(lp.top_ids), top_logprobs=list(lp.top_logprobs)
                )
                for lp in r.logprobs
            ],
            kv=worker_pb2.KvReport(
                live_seqs=r.kv.live_seqs,
                seq_slots=r.kv.seq_slots,
                capacity_tokens=r.kv.capacity_tokens,
                device_mem_used_bytes=r.kv.device_mem_used_bytes,
                host_seqs=r.kv.host_seqs,
            ),
            forward_s=r.forward_s,
            error=r.error,
        )
    )


def result_from_proto(r: worker_pb2.StepResult) -> StepResult:
    """The inverse of result_to_proto (used by tests and fake control planes)."""
    return StepResult(
        step_id=r.step_id,
        handles=_array(r.handles, np.uint64),
        token_ids=_array(r.token_ids, np.int64),
        kv=KvReport(
            live_seqs=r.kv.live_seqs,
            seq_slots=r.kv.seq_slots,
            capacity_tokens=r.kv.capacity_tokens,
            device_mem_used_bytes=r.kv.device_mem_used_bytes,
            host_seqs=r.kv.host_seqs,
        ),
        forward_s=r.forward_s,
        logprobs=tuple(
            TokenLogprobs(lp.logprob, tuple(lp.top_ids), tuple(lp.top_logprobs)) for lp in r.logprobs
        ),
        error=r.error,
    )
