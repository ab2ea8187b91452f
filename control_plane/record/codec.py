"""Recording entries <-> protobuf Records. The only module that imports the record stubs.

Plans, results and worker limits reuse the worker link's messages and its codec
(protos/worker_codec.py). A plan is recorded with its decode set in full (on the stream it is a
delta against the plan before), so every recorded plan reads on its own; a result is recorded as
the worker sent it (tokens in plan order, no handles).
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np

from control_plane.config import SchedulerConfig
from control_plane.record.entries import (
    Abort,
    AddRequest,
    ApplyResult,
    Entry,
    Export,
    Finish,
    Finished,
    Header,
    ImportKv,
    NextPlan,
    OnIdle,
    SendKv,
    SpillTo,
    StepFigures,
)
from control_plane.request import AbortCode, FinishKind, FinishReason, RequestParams
from control_plane.scheduler.scheduler import StepStats
from protos import worker_codec as link
from protos.arrays import INT64, pack, unpack
from protos.stepwise.v1 import record_pb2 as rec_pb
from protos.worker import StepKind

# The layout this codec writes and reads. 2: worker protocol 2's messages (1 had results naming
# their handles and plans' arrays as packed fields; its plans would read back without decodes).
FORMAT_VERSION = 2


def unsupported_format(header: Header) -> str:
    """Why a recording with this header cannot be read ("" when it can)."""
    if header.format_version == FORMAT_VERSION:
        return ""
    return (
        f"recording format {header.format_version} is not supported (this version reads format "
        f"{FORMAT_VERSION}); record the session again"
    )


# --- scheduler config and header ----------------------------------------------------------------


def config_to_json(config: SchedulerConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def config_from_json(text: str) -> SchedulerConfig:
    """Unknown names are ignored (with a warning); missing ones take today's defaults."""
    raw = json.loads(text)
    known = {f.name for f in dataclasses.fields(SchedulerConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        warnings.warn(f"recording: ignoring unknown scheduler settings {unknown}", stacklevel=2)
    return SchedulerConfig(**{k: v for k, v in raw.items() if k in known})


def _header_to_proto(h: Header) -> rec_pb.Header:
    return rec_pb.Header(
        format_version=FORMAT_VERSION,
        scheduler_config_json=config_to_json(h.scheduler),
        worker=link.hello_to_proto(h.limits).hello,
        seeds=dict(h.seeds),
        part=h.part,
        first_step=h.first_step,
        writer=h.writer,
    )


def _header_from_proto(m: rec_pb.Header) -> Header:
    return Header(
        scheduler=config_from_json(m.scheduler_config_json),
        limits=link.hello_from_proto(m.worker),
        seeds=dict(m.seeds),
        part=m.part,
        first_step=m.first_step,
        writer=m.writer,
        format_version=m.format_version,
    )


# --- requests and reasons -----------------------------------------------------------------------


def _reason_to_proto(r: FinishReason) -> rec_pb.Outcome:
    return rec_pb.Outcome(kind=r.kind.value, message=r.message, code=r.code.value if r.code else "")


def _reason_from_proto(m: rec_pb.Outcome) -> FinishReason:
    return FinishReason(FinishKind(m.kind), m.message, AbortCode(m.code) if m.code else None)


def _params_to_proto(p: RequestParams) -> rec_pb.RequestParams:
    return rec_pb.RequestParams(
        has_max_new_tokens=p.max_new_tokens is not None,
        max_new_tokens=p.max_new_tokens or 0,
        min_new_tokens=p.min_new_tokens,
        stop=list(p.stop),
        stop_token_ids=sorted(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        sampler=link.sampler_to_proto(p.sampler),
        has_priority=p.priority is not None,
        priority=p.priority or 0,
        routing_key=p.routing_key,
        group=p.group,
        sim_output_len=p.sim_output_len,
        generated_before=p.generated_before,
        logprobs=p.logprobs,
        logprob_start_len=p.logprob_start_len if p.logprob_start_len >= 0 else None,
        tenant=p.tenant,
        ttft_slo_ms=p.ttft_slo_ms,
        tpot_slo_ms=p.tpot_slo_ms,
    )


def _params_from_proto(m: rec_pb.RequestParams) -> RequestParams:
    return RequestParams(
        max_new_tokens=m.max_new_tokens if m.has_max_new_tokens else None,
        min_new_tokens=m.min_new_tokens,
        stop=tuple(m.stop),
        stop_token_ids=frozenset(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        sampler=link.sampler_from_proto(m.sampler),
        priority=m.priority if m.has_priority else None,
        routing_key=m.routing_key,
        group=m.group,
        sim_output_len=m.sim_output_len,
        generated_before=m.generated_before,
        logprobs=m.logprobs,
        logprob_start_len=m.logprob_start_len if m.HasField("logprob_start_len") else -1,
        tenant=m.tenant,
        ttft_slo_ms=m.ttft_slo_ms,
        tpot_slo_ms=m.tpot_slo_ms,
    )


# --- stats ----------------------------------------------------------------------------------------


def _figures_to_proto(f: StepFigures) -> rec_pb.StepFigures:
    s = f.stats
    return rec_pb.StepFigures(
        step=s.step_id,
        kind=s.kind.value,
        new_seqs=s.new_seqs,
        new_tokens=s.new_tokens,
        cached_tokens=s.cached_tokens,
        running_at_admission=s.running_at_admission,
        decode_bs=s.decode_bs,
        queued=s.queued,
        pending_tokens=s.pending_tokens,
        new_token_ratio=s.new_token_ratio,
        admission_ratio=f.admission_ratio,
        has_rem=s.rem_total_tokens is not None,
        rem_total_tokens=s.rem_total_tokens or 0.0,
        rem_input_tokens=s.rem_input_tokens or 0,
        has_rem_chunk=s.rem_chunk_tokens is not None,
        rem_chunk_tokens=s.rem_chunk_tokens or 0,
        retracted=s.retracted,
        retract_tokens_gained=s.retract_tokens_gained,
        ratio_before_retract=s.ratio_before_retract,
        kv_full=s.kv_full,
        running=f.running,
        kv_used=f.kv_used,
        kv_capacity=f.kv_capacity,
    )


def _figures_from_proto(m: rec_pb.StepFigures) -> StepFigures:
    stats = StepStats(
        step_id=m.step,
        kind=StepKind(m.kind),
        new_seqs=m.new_seqs,
        new_tokens=m.new_tokens,
        cached_tokens=m.cached_tokens,
        running_at_admission=m.running_at_admission,
        decode_bs=m.decode_bs,
        queued=m.queued,
        pending_tokens=m.pending_tokens,
        new_token_ratio=m.new_token_ratio,
        rem_total_tokens=m.rem_total_tokens if m.has_rem else None,
        rem_input_tokens=m.rem_input_tokens if m.has_rem else None,
        rem_chunk_tokens=m.rem_chunk_tokens if m.has_rem_chunk else None,
        retracted=list(m.retracted),
        retract_tokens_gained=m.retract_tokens_gained,
        ratio_before_retract=m.ratio_before_retract,
        kv_full=m.kv_full,
    )
    return StepFigures(stats, m.admission_ratio, m.running, m.kv_used, m.kv_capacity)


# --- entries --------------------------------------------------------------------------------------


# Plans and results are the hot path (one each per step): fill the Record in place, because every
# nested constructor call copies the whole sub-message.


def _next_plan_record(e: NextPlan) -> rec_pb.Record:
    record = rec_pb.Record()
    call = record.next_plan
    call.step = e.step
    call.always = e.always
    call.at_s = e.at_s
    if e.plan is not None:
        call.plan.CopyFrom(link.plan_to_proto(e.plan).plan)
        call.has_plan, call.kind = True, e.plan.kind.value
    return record


def _apply_result_record(e: ApplyResult) -> rec_pb.Record:
    record = rec_pb.Record()
    record.apply_result.result.CopyFrom(link.result_to_proto(e.result).result)
    record.apply_result.at_s = e.at_s
    return record


def _next_plan_from_proto(m: rec_pb.NextPlanCall) -> NextPlan:
    if not m.has_plan:
        return NextPlan(m.step, None, m.always, m.at_s)
    plan = link.plan_from_proto(m.plan)
    if m.kind and plan.kind.value != m.kind:
        plan = dataclasses.replace(plan, kind=StepKind(m.kind))
    return NextPlan(m.step, plan, m.always, m.at_s)


def _slots_bytes(slots: tuple[int, ...]) -> bytes:
    return pack(np.asarray(slots, dtype=np.int64), INT64)


def _slots_tuple(data: bytes, name: str) -> tuple[int, ...]:
    return tuple(unpack(data, INT64, name).tolist())


def _export_to_proto(e: Export) -> rec_pb.ExportCall:
    return rec_pb.ExportCall(
        step=e.step,
        rid=e.rid,
        reason=_reason_to_proto(e.reason),
        transfer_id=e.transfer_id,
        address=e.address,
        applied=e.slots is not None,
        slots=_slots_bytes(e.slots or ()),
        start=e.start,
    )


def _export_from_proto(m: rec_pb.ExportCall) -> Export:
    slots = _slots_tuple(m.slots, "export.slots") if m.applied else None
    return Export(m.step, m.rid, _reason_from_proto(m.reason), m.transfer_id, m.address, slots, m.start)


def _import_to_proto(e: ImportKv) -> rec_pb.ImportCall:
    skip, slots = e.outcome if e.outcome is not None else (0, ())
    return rec_pb.ImportCall(
        step=e.step,
        transfer_id=e.transfer_id,
        input_ids=e.input_ids,
        applied=e.outcome is not None,
        skip=skip,
        slots=_slots_bytes(slots),
        start=e.start,
        hold=e.hold,
    )


def _import_from_proto(m: rec_pb.ImportCall) -> ImportKv:
    outcome = (m.skip, _slots_tuple(m.slots, "import_kv.slots")) if m.applied else None
    return ImportKv(m.step, m.transfer_id, tuple(m.input_ids), outcome, m.start, m.hold)


def entry_to_proto(e: Entry) -> rec_pb.Record:
    match e:
        case Header():
            return rec_pb.Record(header=_header_to_proto(e))
        case AddRequest():
            return rec_pb.Record(add_request=_add_request_to_proto(e))
        case Abort():
            return rec_pb.Record(
                abort=rec_pb.AbortCall(
                    step=e.step, rid=e.rid, reason=_reason_to_proto(e.reason), applied=e.applied
                )
            )
        case Finish():
            return rec_pb.Record(
                finish=rec_pb.FinishCall(
                    step=e.step, rid=e.rid, reason=_reason_to_proto(e.reason), applied=e.applied
                )
            )
        case NextPlan():
            return _next_plan_record(e)
        case ApplyResult():
            return _apply_result_record(e)
        case OnIdle():
            return rec_pb.Record(on_idle=rec_pb.OnIdleCall(step=e.step))
        case Export():
            return rec_pb.Record(export=_export_to_proto(e))
        case ImportKv():
            return rec_pb.Record(import_kv=_import_to_proto(e))
        case SendKv():
            return rec_pb.Record(
                send_kv=rec_pb.SendKvCall(
                    step=e.step, rid=e.rid, transfer_id=e.transfer_id, address=e.address, tokens=e.tokens
                )
            )
        case SpillTo():
            return rec_pb.Record(spill_to=rec_pb.SpillCall(step=e.step, address=e.address, tokens=e.tokens))
        case StepFigures():
            return rec_pb.Record(stats=_figures_to_proto(e))
        case Finished():
            return rec_pb.Record(finished=_finished_to_proto(e))
    raise TypeError(f"not a recording entry: {e!r}")


def _add_request_to_proto(e: AddRequest) -> rec_pb.AddRequestCall:
    return rec_pb.AddRequestCall(
        step=e.step,
        rid=e.rid,
        input_ids=e.input_ids,
        params=_params_to_proto(e.params),
        error=e.error,
        at_s=e.at_s,
        received_s=e.received_s,
    )


def _finished_to_proto(e: Finished) -> rec_pb.FinishedEvent:
    return rec_pb.FinishedEvent(
        step=e.step,
        rid=e.rid,
        reason=_reason_to_proto(e.reason),
        cached_tokens=e.cached_tokens,
        at_s=e.at_s,
    )


def entry_from_proto(m: rec_pb.Record) -> Entry:
    """ValueError for an empty Record (written by a newer version, or garbage)."""
    which = m.WhichOneof("entry")
    match which:
        case "header":
            return _header_from_proto(m.header)
        case "add_request":
            a = m.add_request
            params = _params_from_proto(a.params)
            return AddRequest(a.step, a.rid, tuple(a.input_ids), params, a.error, a.at_s, a.received_s)
        case "abort":
            return Abort(m.abort.step, m.abort.rid, _reason_from_proto(m.abort.reason), m.abort.applied)
        case "finish":
            f = m.finish
            return Finish(f.step, f.rid, _reason_from_proto(f.reason), f.applied)
        case "next_plan":
            return _next_plan_from_proto(m.next_plan)
        case "apply_result":
            return ApplyResult(link.result_from_proto(m.apply_result.result), m.apply_result.at_s)
        case "on_idle":
            return OnIdle(m.on_idle.step)
        case "export":
            return _export_from_proto(m.export)
        case "import_kv":
            return _import_from_proto(m.import_kv)
        case "send_kv":
            k = m.send_kv
            return SendKv(k.step, k.rid, k.transfer_id, k.address, k.tokens)
        case "spill_to":
            return SpillTo(m.spill_to.step, m.spill_to.address, m.spill_to.tokens)
        case "stats":
            return _figures_from_proto(m.stats)
        case "finished":
            d = m.finished
            return Finished(d.step, d.rid, _reason_from_proto(d.reason), d.cached_tokens, d.at_s)
    raise ValueError(f"unknown record entry {which!r}")


def encode(e: Entry) -> bytes:
    return entry_to_proto(e).SerializeToString()


def decode(data: bytes) -> Entry:
    """ValueError (or protobuf's DecodeError) for bytes that are not a Record."""
    record = rec_pb.Record()
    record.ParseFromString(data)
    return entry_from_proto(record)
