"""Protobuf <-> data_plane.messages. The only data_plane module that imports the generated stubs.

Plans are read by a PlanDecoder, one per session: the decode set arrives as a delta against the
previous decode plan (protos/decode_set.py) and leaves as whole handle and slot arrays. Big arrays
are little-endian `bytes` fields (protos/arrays.py); a malformed one is a ValueError naming it.

Normalisation on the way in: proto3 cannot tell "unset" from zero, so top_p <= 0 and
repetition_penalty <= 0 mean "off" (1.0), and has_seed=false means no seed.
"""

from __future__ import annotations

import numpy as np

from data_plane.messages import (
    Census,
    ControlEvent,
    DecodeBatch,
    Drain,
    ExtendBatch,
    Hello,
    KvReport,
    KvTransfer,
    Move,
    NewSequence,
    SamplerParams,
    Shutdown,
    SlotRemap,
    StepPlan,
    StepResult,
    TokenLogprobs,
    Welcome,
)
from protos import decode_set
from protos.arrays import INT32, INT64, WireError, pack, unpack
from protos.stepwise.v1 import worker_pb2

# ---- control -> worker -------------------------------------------------------------------------


class PlanDecoder:
    """Reads the plans of one session in the order they arrive, keeping the decode set they diff
    against. A plan that cannot be read raises ValueError and leaves the state as it was."""

    def __init__(self) -> None:
        self._decodes = decode_set.EMPTY

    def control(self, msg: worker_pb2.ControlMessage) -> ControlEvent:
        """Decode one ControlMessage; ValueError if it carries nothing or a plan that cannot be read."""
        kind = msg.WhichOneof("msg")
        if kind == "welcome":
            w = msg.welcome
            return Welcome(accepted=w.accepted, reason=w.reason, retryable=w.retryable)
        if kind == "plan":
            return self.plan(msg.plan)
        if kind == "shutdown":
            return Shutdown(reason=msg.shutdown.reason)
        if kind == "move":
            return Move(reason=msg.move.reason)
        raise ValueError("empty ControlMessage")

    def plan(self, p: worker_pb2.StepPlan) -> StepPlan:
        prev = decode_set.EMPTY if p.reset else self._decodes
        decoded = decode_set.decode(prev, decode_set.from_proto(p.decodes))
        releases = _array(p.release_handles, np.uint64)
        if decoded is not None:
            _check_released_gone(decoded, releases)
        plan = _plan_from_proto(p, releases, decoded)
        self._decodes = prev if decoded is None else decoded
        return plan


def _check_released_gone(decoded: decode_set.DecodeSet, releases: np.ndarray) -> None:
    at = decoded.index.positions(releases)
    if len(at) and int(at.max()) >= 0:
        handle = releases[int(np.argmax(at))]
        raise WireError(f"decodes: handle {handle} is released by this plan but still in its decode set")


def control_from_proto(msg: worker_pb2.ControlMessage) -> ControlEvent:
    """One ControlMessage on its own (a plan must carry its decode set in full); ValueError."""
    return PlanDecoder().control(msg)


def plan_from_proto(p: worker_pb2.StepPlan) -> StepPlan:
    """One plan on its own (its decode set in full); ValueError when it cannot be read."""
    return PlanDecoder().plan(p)


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


def _plan_from_proto(
    p: worker_pb2.StepPlan, releases: np.ndarray, decoded: decode_set.DecodeSet | None
) -> StepPlan:
    decodes = DecodeBatch() if decoded is None else DecodeBatch(handles=decoded.handles, slots=decoded.slots)
    return StepPlan(
        step_id=p.step_id,
        release_handles=releases,
        reset=p.reset,
        offloads=tuple(KvTransfer(t.handle, unpack(t.slots, INT64, "offloads.slots")) for t in p.offloads),
        restores=tuple(KvTransfer(t.handle, unpack(t.slots, INT64, "restores.slots")) for t in p.restores),
        new_seqs=tuple(_new_seq_from_proto(s) for s in p.new_seqs),
        extends=_extends_from_proto(p.extends),
        decodes=decodes,
        remaps=tuple(SlotRemap(r.handle, r.start, unpack(r.slots, INT64, "remaps.slots")) for r in p.remaps),
    )


_NO_EXTENDS = ExtendBatch()


def _extends_from_proto(e: worker_pb2.ExtendBatch) -> ExtendBatch:
    if not e.ByteSize():  # most decode steps: nothing to extend
        return _NO_EXTENDS
    return ExtendBatch(
        handles=_array(e.handles, np.uint64),
        starts=_array(e.starts, np.int64),
        lens=_array(e.lens, np.int64),
        sample=_array(e.sample, np.bool_),
        token_ids=unpack(e.token_ids, INT32, "extends.token_ids"),
        slots=unpack(e.slots, INT64, "extends.slots"),
    )


def _new_seq_from_proto(s: worker_pb2.NewSequence) -> NewSequence:
    return NewSequence(
        handle=s.handle,
        sampler=sampler_from_proto(s.sampler),
        prefix_slots=unpack(s.prefix_slots, INT64, "new_seqs.prefix_slots"),
        history_ids=_array(s.history_ids, np.int64),
        request_id=s.request_id,
        sim_output_len=s.sim_output_len,
        prompt_len=s.prompt_len,
    )


def _array(values: object, dtype: type) -> np.ndarray:
    return np.fromiter(values, dtype=dtype, count=len(values))  # type: ignore[arg-type, call-overload]


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
    """The inverse of plan_from_proto, decode set in full (used by tests and fake control planes)."""
    e, d = plan.extends, plan.decodes
    msg = worker_pb2.StepPlan(
        step_id=plan.step_id,
        reset=plan.reset,
        release_handles=plan.release_handles.tolist(),
        offloads=[worker_pb2.KvTransfer(handle=t.handle, slots=pack(t.slots, INT64)) for t in plan.offloads],
        restores=[worker_pb2.KvTransfer(handle=t.handle, slots=pack(t.slots, INT64)) for t in plan.restores],
        new_seqs=[
            worker_pb2.NewSequence(
                handle=s.handle,
                sampler=sampler_to_proto(s.sampler),
                prefix_slots=pack(s.prefix_slots, INT64),
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
            token_ids=pack(e.token_ids, INT32),
            slots=pack(e.slots, INT64),
        ),
        remaps=[
            worker_pb2.SlotRemap(handle=r.handle, start=r.start, slots=pack(r.slots, INT64))
            for r in plan.remaps
        ],
    )
    full, _ = decode_set.encode(decode_set.EMPTY, d.handles, d.slots, allow_delta=False)
    if full.count:
        decode_set.fill(msg.decodes, full)
    return msg


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


def drain_to_proto(d: Drain) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(drain=worker_pb2.Drain(reason=d.reason))


def result_to_proto(r: StepResult) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(
        result=worker_pb2.StepResult(
            step_id=r.step_id,
            token_ids=pack(r.token_ids, INT32),
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
            wait_s=r.wait_s,
        )
    )


def result_from_proto(r: worker_pb2.StepResult) -> StepResult:
    """The inverse of result_to_proto (used by tests and fake control planes)."""
    return StepResult(
        step_id=r.step_id,
        token_ids=unpack(r.token_ids, INT32, "token_ids"),
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
        wait_s=r.wait_s,
    )


# ---- census ------------------------------------------------------------------------------------


def census_request() -> worker_pb2.CensusRequest:
    return worker_pb2.CensusRequest()


def census_from_proto(c: worker_pb2.CensusReply) -> Census:
    return Census(
        control_plane_id=c.control_plane_id,
        workers=c.workers,
        queued=c.queued,
        running=c.running,
        accepting=c.accepting,
        model_fingerprint=c.model_fingerprint,
    )


def census_to_proto(c: Census) -> worker_pb2.CensusReply:
    """The inverse of census_from_proto (used by tests and fake control planes)."""
    return worker_pb2.CensusReply(
        control_plane_id=c.control_plane_id,
        workers=c.workers,
        queued=c.queued,
        running=c.running,
        accepting=c.accepting,
        model_fingerprint=c.model_fingerprint,
    )
