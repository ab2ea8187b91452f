"""The worker link's one codec: protos/worker.py's values <-> worker.proto's messages, both ways,
for both planes. The only module besides protos/decode_set.py that reads or writes worker stubs.

What goes on a stream is encoded as its envelope: `plan_to_proto` and `PlanEncoder.encode` give a
ControlMessage, `result_to_proto`, `hello_to_proto`, `drain_to_proto` and `received_to_proto` a
WorkerMessage, `control_to_proto` the ControlMessage of a welcome, shutdown or move. Decoders take
the inner message (`plan_from_proto(msg.plan)`), except `control_from_proto` and
`PlanDecoder.control`, which read a worker's whole ControlMessage.

Plans travel with their decode set as a delta against the previous decode plan of the link
(protos/decode_set.py): the control plane's PlanEncoder and the worker's PlanDecoder each keep that
set, one per link, fed every plan in order. A plan on its own (`plan_to_proto`, a recording) carries
its decode set in full.

Checks on the way in, where each side is strict about what the other sent:
- a plan the worker cannot read is a WireError (a ValueError) naming the field: a malformed array,
  a decode delta that cannot apply, a handle released by the plan that is still in its decode set,
  a handle past int64;
- a result that breaks the protocol is a ProtocolError (the worker is at fault): tokens that are not
  whole int32 values, a count other than what the plan sampled, logprobs not one per token, a
  duration that is not one;
- proto3 cannot tell "unset" from zero, so sampler fields normalise to "off" (top_p <= 0 or >= 1 and
  repetition_penalty <= 0 mean 1.0, negatives 0), a census's negative counts to 0, and a hello's
  page size 0 to 1.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from protos import decode_set
from protos.arrays import INT32, INT64, WireError, pack, unpack
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.worker import (
    Census,
    ControlEvent,
    DecodeWork,
    Drain,
    Dropped,
    ExtendWork,
    Grammar,
    GrammarReady,
    KvReceive,
    KvReport,
    KvSend,
    KvTransfer,
    Move,
    NewSeq,
    Prepare,
    PromptScores,
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
)

_MAX_HANDLE = (1 << 63) - 1


class ProtocolError(ValueError):
    """A worker's message that breaks the protocol; the message says how. The worker is at fault."""


# --- sampler parameters --------------------------------------------------------------------------


def sampler_to_proto(s: SamplerParams) -> wk_pb.SamplerParams:
    msg = _sampler_to_proto(s)
    if s.grammar is not None:
        msg.grammar.backend, msg.grammar.kind, msg.grammar.spec = (
            s.grammar.backend,
            s.grammar.kind,
            s.grammar.spec,
        )
    return msg


def _sampler_to_proto(s: SamplerParams) -> wk_pb.SamplerParams:
    return wk_pb.SamplerParams(
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
        logit_bias=dict(s.logit_bias),
        token_ids_logprob=s.token_ids_logprob,
        processed_logprobs=s.processed_logprobs,
    )


def sampler_from_proto(p: wk_pb.SamplerParams) -> SamplerParams:
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
        logit_bias=tuple(sorted(p.logit_bias.items())),
        token_ids_logprob=tuple(p.token_ids_logprob),
        processed_logprobs=p.processed_logprobs,
        grammar=Grammar(p.grammar.backend, p.grammar.kind, p.grammar.spec) if p.HasField("grammar") else None,
    )


# --- plans: encoding (the control plane) -----------------------------------------------------------


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
    for send in plan.sends:
        msg.sends.add(transfer_id=send.transfer_id, address=send.address, slots=pack(send.slots, INT64))
    for receive in plan.receives:
        msg.receives.add(transfer_id=receive.transfer_id, slots=pack(receive.slots, INT64), skip=receive.skip)
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
    if len(ext.score_lens):
        msg.score_starts.extend(ext.score_starts.tolist())
        msg.score_lens.extend(ext.score_lens.tolist())
        msg.next_ids.extend(ext.next_ids.tolist())


# --- plans: decoding (the worker; recordings) -------------------------------------------------------


class PlanDecoder:
    """Reads the plans of one session in the order they arrive, keeping the decode set they diff
    against. A plan that cannot be read raises WireError and leaves the state as it was."""

    def __init__(self) -> None:
        self._decodes = decode_set.EMPTY

    def control(self, msg: wk_pb.ControlMessage) -> ControlEvent:
        """Decode one ControlMessage; ValueError if it carries nothing or a plan that cannot be read."""
        kind = msg.WhichOneof("msg")
        if kind == "plan":
            return self.plan(msg.plan)
        if kind == "welcome":
            w = msg.welcome
            return Welcome(
                accepted=w.accepted,
                reason=w.reason,
                retryable=w.retryable,
                transfer_reports=w.transfer_reports,
            )
        if kind == "shutdown":
            return Shutdown(reason=msg.shutdown.reason)
        if kind == "move":
            return Move(reason=msg.move.reason)
        if kind == "dropped":
            return Dropped(reason=msg.dropped.reason)
        if kind == "prepare":
            return Prepare(_grammar_from_proto(msg.prepare))
        raise ValueError("empty ControlMessage")

    def plan(self, p: wk_pb.StepPlan) -> StepPlan:
        prev = decode_set.EMPTY if p.reset else self._decodes
        decoded = decode_set.decode(prev, decode_set.from_proto(p.decodes))
        releases = _handles(p.release_handles, "release_handles")
        if decoded is not None:
            _check_released_gone(decoded, releases)
        plan = _plan_from_proto(p, releases, decoded)
        self._decodes = prev if decoded is None else decoded
        return plan


def plan_from_proto(p: wk_pb.StepPlan) -> StepPlan:
    """One plan on its own (its decode set in full); WireError when it cannot be read."""
    return PlanDecoder().plan(p)


def control_from_proto(msg: wk_pb.ControlMessage) -> ControlEvent:
    """One ControlMessage on its own (a plan must carry its decode set in full); ValueError."""
    return PlanDecoder().control(msg)


def _check_released_gone(decoded: decode_set.DecodeSet, releases: np.ndarray) -> None:
    at = decoded.index.positions(releases)
    if len(at) and int(at.max()) >= 0:
        handle = releases[int(np.argmax(at))]
        raise WireError(f"decodes: handle {handle} is released by this plan but still in its decode set")


def _plan_from_proto(
    p: wk_pb.StepPlan, releases: np.ndarray, decoded: decode_set.DecodeSet | None
) -> StepPlan:
    # The encoder sets `extends` only when there is extend work. HasField, not ByteSize: with the upb
    # backend ByteSize serializes the submessage (~190 µs for a 16k-token batch) on every plan.
    extends = _extends_from_proto(p.extends) if p.HasField("extends") else _NO_EXTENDS
    decodes = _NO_DECODES if decoded is None else DecodeWork(handles=decoded.handles, slots=decoded.slots)
    return StepPlan(
        step_id=p.step_id,
        kind=StepKind.of(len(extends), len(decodes)),
        releases=releases,
        reset=p.reset,
        offloads=tuple(_transfer(t, "offloads") for t in p.offloads),
        restores=tuple(_transfer(t, "restores") for t in p.restores),
        new_seqs=tuple(_new_seq_from_proto(s) for s in p.new_seqs),
        extends=extends,
        decodes=decodes,
        remaps=tuple(
            SlotRemap(_handle(r.handle, "remaps"), r.start, unpack(r.slots, INT64, "remaps.slots"))
            for r in p.remaps
        ),
        sends=tuple(_send_from_proto(t) for t in p.sends),
        receives=tuple(
            KvReceive(
                _transfer_id(t.transfer_id, "receives"), unpack(t.slots, INT64, "receives.slots"), t.skip
            )
            for t in p.receives
        ),
    )


def _send_from_proto(t: wk_pb.KvSend) -> KvSend:
    slots = unpack(t.slots, INT64, "sends.slots")
    if not len(slots):
        raise WireError("sends.slots: a send names at least one slot")
    if not t.address:
        raise WireError("sends.address: empty")
    return KvSend(_transfer_id(t.transfer_id, "sends"), t.address, slots)


def _transfer_id(value: str, name: str) -> str:
    if not value:
        raise WireError(f"{name}.transfer_id: empty")
    return value


# Most decode steps extend nothing, and plans without decode work are common: share the empty work
# (zero-length arrays; nobody writes to a plan's columns).
_NO_EXTENDS = ExtendWork()
_NO_DECODES = DecodeWork()


def _extends_from_proto(e: wk_pb.ExtendBatch) -> ExtendWork:
    work = ExtendWork(
        handles=_handles(e.handles, "extends.handles"),
        starts=_array(e.starts, np.int32),
        lens=_array(e.lens, np.int32),
        sample=_array(e.sample, np.bool_),
        token_ids=unpack(e.token_ids, INT32, "extends.token_ids", np.int32),
        slots=unpack(e.slots, INT64, "extends.slots"),
    )
    if not (e.score_starts or e.score_lens or e.next_ids):
        return work
    return dataclasses.replace(
        work,
        score_starts=_array(e.score_starts, np.int32),
        score_lens=_array(e.score_lens, np.int32),
        next_ids=_array(e.next_ids, np.int32),
    )


def _new_seq_from_proto(s: wk_pb.NewSequence) -> NewSeq:
    return NewSeq(
        handle=_handle(s.handle, "new_seqs"),
        sampler=sampler_from_proto(s.sampler),
        prefix_slots=unpack(s.prefix_slots, INT64, "new_seqs.prefix_slots"),
        history_ids=_array(s.history_ids, np.int32),
        request_id=s.request_id,
        prompt_len=s.prompt_len,
        sim_output_len=s.sim_output_len,
    )


def _transfer(t: wk_pb.KvTransfer, name: str) -> KvTransfer:
    return KvTransfer(_handle(t.handle, name), unpack(t.slots, INT64, f"{name}.slots"))


def _handle(value: int, name: str) -> int:
    if value > _MAX_HANDLE:
        raise WireError(f"{name}: handle {value} is past 2^63 - 1")
    return value


def _handles(values: object, name: str) -> np.ndarray:
    try:
        return _array(values, np.int64)
    except OverflowError:
        raise WireError(f"{name}: a handle is past 2^63 - 1") from None


def _array(values: object, dtype: type) -> np.ndarray:
    return np.fromiter(values, dtype=dtype, count=len(values))  # type: ignore[arg-type, call-overload]


# --- results ---------------------------------------------------------------------------------------


def result_to_proto(r: StepResult) -> wk_pb.WorkerMessage:
    """Filled in place: a nested constructor would copy each sub-message."""
    message = wk_pb.WorkerMessage()
    msg = message.result
    msg.step_id, msg.forward_s, msg.wait_s, msg.error = r.step_id, r.forward_s, r.wait_s, r.error
    msg.token_ids = pack(r.token_ids, INT32)
    for lp in r.logprobs:
        _fill_logprobs(msg.logprobs.add(), lp)
    for scores in r.prompt_scores:
        entry = msg.prompt_scores.add(entry=scores.entry)
        for lp in scores.rows:
            _fill_logprobs(entry.rows.add(), lp)
    kv, out = r.kv, msg.kv
    out.live_seqs, out.seq_slots, out.capacity_tokens = kv.live_seqs, kv.seq_slots, kv.capacity_tokens
    out.device_mem_used_bytes, out.host_seqs = kv.device_mem_used_bytes, kv.host_seqs
    for t in r.transfers:
        msg.transfers.add(transfer_id=t.transfer_id, error=t.error, bytes=t.bytes)
    msg.grammar_failed.extend(r.grammar_failed.tolist())
    return message


def _fill_logprobs(msg: wk_pb.TokenLogprobs, lp: TokenLogprobs) -> None:
    msg.logprob = lp.logprob
    msg.top_ids.extend(lp.top_ids)
    msg.top_logprobs.extend(lp.top_logprobs)
    msg.ids_logprobs.extend(lp.ids_logprobs)


def _logprobs(msg: wk_pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.logprob, tuple(msg.top_ids), tuple(msg.top_logprobs), tuple(msg.ids_logprobs))


def result_from_proto(msg: wk_pb.StepResult, sampled: int | None = None) -> StepResult:
    """Decode a worker's result; ProtocolError when it cannot be one, or (given `sampled`, what the
    plan sampled) when its token count differs. An error result carries no tokens. Step id and
    vocabulary are control_plane/core/worker_checks.py's."""
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
    failed = np.asarray(msg.grammar_failed, dtype=np.int64)
    if len(failed) and (failed[-1] >= len(tokens) or bool((np.diff(failed) <= 0).any())):
        raise ProtocolError(
            f"result for step {msg.step_id}: grammar_failed must be ascending indices below {len(tokens)}"
        )
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
        logprobs=tuple(_logprobs(lp) for lp in msg.logprobs),
        prompt_scores=tuple(
            PromptScores(s.entry, tuple(_logprobs(lp) for lp in s.rows)) for s in msg.prompt_scores
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
        transfers=tuple(TransferOutcome(t.transfer_id, t.error, t.bytes) for t in msg.transfers),
        grammar_failed=np.asarray(msg.grammar_failed, dtype=np.int32),
    )


# --- the session -----------------------------------------------------------------------------------


def hello_to_proto(limits: WorkerLimits) -> wk_pb.WorkerMessage:
    hello = wk_pb.Hello(
        worker_id=limits.worker_id,
        model_fingerprint=limits.model_fingerprint,
        kv_capacity_tokens=limits.kv_capacity_tokens,
        page_size=limits.page_size,
        max_context=limits.max_context,
        vocab_size=limits.vocab_size,
        dtype=limits.dtype,
        device=limits.device,
        protocol_version=limits.protocol_version,
        eos_token_ids=sorted(limits.eos_token_ids),
        host_pool_capacity_tokens=limits.host_pool_capacity_tokens,
        grammar_backends=limits.grammar_backends,
        transfer_address=limits.transfer_address,
        role=limits.role,
        prepares_grammars=limits.prepares_grammars,
    )
    return wk_pb.WorkerMessage(hello=hello)


def hello_from_proto(hello: wk_pb.Hello) -> WorkerLimits:
    """The limits as the scheduler uses them (page size 0, unset, is 1). Whether the control plane
    accepts them (protocol version, page size, fingerprint) is the server's to decide."""
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
        protocol_version=hello.protocol_version,
        grammar_backends=tuple(hello.grammar_backends),
        transfer_address=hello.transfer_address,
        role=hello.role or "mixed",
        prepares_grammars=hello.prepares_grammars,
    )


def control_to_proto(event: Welcome | Shutdown | Move | Dropped) -> wk_pb.ControlMessage:
    """A welcome, shutdown, move or drop as the control plane writes it (plans go through PlanEncoder)."""
    match event:
        case Welcome():
            welcome = wk_pb.Welcome(
                accepted=event.accepted,
                reason=event.reason,
                retryable=event.retryable,
                transfer_reports=event.transfer_reports,
            )
            return wk_pb.ControlMessage(welcome=welcome)
        case Shutdown():
            return wk_pb.ControlMessage(shutdown=wk_pb.Shutdown(reason=event.reason))
        case Move():
            return wk_pb.ControlMessage(move=wk_pb.Move(reason=event.reason))
        case Dropped():
            return wk_pb.ControlMessage(dropped=wk_pb.Dropped(reason=event.reason))
    raise TypeError(f"not a welcome, shutdown, move or drop: {event!r}")


def prepare_to_proto(grammar: Grammar) -> wk_pb.ControlMessage:
    """Ask the worker to compile `grammar` off its step (answered with GrammarReady)."""
    return wk_pb.ControlMessage(prepare=_grammar_to_proto(grammar))


def grammar_ready_to_proto(ready: GrammarReady) -> wk_pb.WorkerMessage:
    msg = wk_pb.GrammarReady(grammar=_grammar_to_proto(ready.grammar), error=ready.error)
    return wk_pb.WorkerMessage(grammar_ready=msg)


def grammar_ready_from_proto(msg: wk_pb.GrammarReady) -> GrammarReady:
    """ProtocolError when it names no grammar."""
    if not msg.HasField("grammar") or not msg.grammar.kind:
        raise ProtocolError("a grammar_ready without its grammar")
    return GrammarReady(_grammar_from_proto(msg.grammar), msg.error)


def _grammar_to_proto(grammar: Grammar) -> wk_pb.Grammar:
    return wk_pb.Grammar(backend=grammar.backend, kind=grammar.kind, spec=grammar.spec)


def _grammar_from_proto(msg: wk_pb.Grammar) -> Grammar:
    return Grammar(msg.backend, msg.kind, msg.spec)


def drain_to_proto(d: Drain) -> wk_pb.WorkerMessage:
    return wk_pb.WorkerMessage(drain=wk_pb.Drain(reason=d.reason))


def received_to_proto(outcome: TransferOutcome) -> wk_pb.WorkerMessage:
    """A destination's report that it holds a transfer in full."""
    received = wk_pb.TransferOutcome(transfer_id=outcome.transfer_id, bytes=outcome.bytes)
    return wk_pb.WorkerMessage(received=received)


def received_from_proto(msg: wk_pb.TransferOutcome) -> TransferOutcome:
    """A destination's report (WorkerMessage `received`); ProtocolError when it names no transfer,
    carries an error (a receiver reports only what it holds) or a negative byte count."""
    if not msg.transfer_id:
        raise ProtocolError("a received report without a transfer_id")
    if msg.error:
        raise ProtocolError(f"received report of {msg.transfer_id[:40]!r} carries an error")
    if msg.bytes < 0:
        raise ProtocolError(f"received report of {msg.transfer_id[:40]!r}: bytes {msg.bytes} is negative")
    return TransferOutcome(msg.transfer_id, "", msg.bytes)


# --- the census --------------------------------------------------------------------------------------


def census_request(hello: WorkerLimits | None = None) -> wk_pb.CensusRequest:
    """A census request, asking too whether the control plane would take a worker with `hello`."""
    if hello is None:
        return wk_pb.CensusRequest()
    return wk_pb.CensusRequest(hello=hello_to_proto(hello).hello)


def census_hello(request: wk_pb.CensusRequest) -> wk_pb.Hello | None:
    """The hello a census request asks about, None when it asks for counts only."""
    return request.hello if request.HasField("hello") else None


def census_to_proto(c: Census) -> wk_pb.CensusReply:
    return wk_pb.CensusReply(
        control_plane_id=c.control_plane_id,
        workers=c.workers,
        queued=c.queued,
        running=c.running,
        accepting=c.accepting,
        model_fingerprint=c.model_fingerprint,
        hello_judged=c.hello_judged,
        refusal=c.refusal,
    )


def census_from_proto(c: wk_pb.CensusReply) -> Census:
    """Negative counts (a peer's bug) read as 0: they would otherwise win every comparison."""
    return Census(
        control_plane_id=c.control_plane_id,
        workers=max(c.workers, 0),
        queued=max(c.queued, 0),
        running=max(c.running, 0),
        accepting=c.accepting,
        model_fingerprint=c.model_fingerprint,
        hello_judged=c.hello_judged,
        refusal=c.refusal,
    )
