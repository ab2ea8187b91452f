"""A frontend's link to its core: the calls and samples it serves, and what the core says of them.

`stepwise control --frontends K` runs K frontend processes beside the core (server.py here).
Each serves the Generation API on the shared client port (generation.py): it authenticates,
validates, tokenizes, sends arrivals, aborts and stop-string finishes to the core, and turns the
core's token batches into client messages (samples.py). It makes no scheduling decision: the core
decides, and records what it saw when it saw it, so replays are unaffected by how many frontends
there are. Together they are SGLang's TokenizerManager and DetokenizerManager.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from collections.abc import Callable

import grpc
import numpy as np
import structlog

from control_plane import link_params, metrics
from control_plane.config import ControlConfig
from control_plane.frontend import client_codec
from control_plane.frontend.detokenize import TextStream
from control_plane.frontend.heartbeat import Heartbeat
from control_plane.frontend.samples import Call, Chunk, Event, Lost, Prompt, Sample
from control_plane.link import UID_LINK_SHIFT, FrameReader, FrameWriter, LinkClosed, TurnFlush
from control_plane.request import AbortCode, FinishKind, FinishReason
from control_plane.tokenizer import Tokenizer
from protos.stepwise.v1 import frontend_pb2 as fe_pb
from protos.stepwise.v1 import generation_pb2 as gen_pb

log = structlog.get_logger("stepwise.frontend")

CORE_GONE = "the control plane's core went away; retry"


@dataclasses.dataclass(frozen=True, slots=True)
class CoreState:
    """What the core last said about the control plane: can it serve, and within which limits."""

    workers: int = 0
    max_context: int = 0
    vocab_size: int = 0
    # The control plane drains: new calls are refused (UNAVAILABLE, retry on another one).
    draining: bool = False

    @property
    def serving(self) -> bool:
        """What the client port's health says: a worker can take new calls here."""
        return self.workers > 0 and not self.draining


class Frontend:
    """Calls and samples of one frontend process, and the link that feeds them.

    Everything here runs on the frontend's event loop. Outgoing parts (arrivals, aborts, stops,
    queries) are merged into one FrontendMessage per loop turn; each CoreMessage is applied whole.
    """

    def __init__(self, config: ControlConfig, tokenizer: Tokenizer, index: int = 0) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.index = index
        self.state = CoreState()
        self.link_id = 0
        self._uids = itertools.count(1)
        self.samples: dict[int, Sample] = {}
        # Calls waiting for the core's verdict, by their first uid.
        self._awaiting: dict[int, Call] = {}
        self._queries: dict[int, asyncio.Future[fe_pb.Reply]] = {}
        self._query_ids = itertools.count(1)
        self._outbox = fe_pb.FrontendMessage()
        self._flush = TurnFlush(self._send_outbox)
        self._writer: FrameWriter | None = None
        # Called with the new state whenever the core sends one (health follows it).
        self.on_state: list[Callable[[CoreState], None]] = []
        self.closed = asyncio.Event()
        self._heartbeat: Heartbeat | None = None
        # Why the core counts as gone when its heartbeat fell silent (the link itself did not close).
        self._silence = ""

    # --- connecting ------------------------------------------------------------------------------

    async def connect(self, path: str) -> None:
        """Dial the core, say hello and wait for the welcome; then read its messages in a task, and
        answer its heartbeat on a second connection (heartbeat.py)."""
        reader, writer = await asyncio.open_unix_connection(path)
        self._writer = FrameWriter(writer)
        hello = fe_pb.FrontendMessage(hello=fe_pb.FrontendHello(index=self.index, pid=os.getpid()))
        self._writer.write(hello)
        frames = FrameReader(reader, fe_pb.CoreMessage)
        first = await frames.read()
        if not first.HasField("welcome"):
            raise LinkClosed("the core's first message is not a welcome")
        self.link_id = first.welcome.link_id
        self.apply(first)
        self._reader = asyncio.create_task(self._read(frames))
        beat_hello = fe_pb.FrontendHello(index=self.index, pid=os.getpid(), heartbeat_of=self.link_id)
        self._heartbeat = Heartbeat(
            path,
            beat_hello,
            self.config.frontend_heartbeat_interval_s,
            self.config.frontend_heartbeat_timeout_s,
            self._core_silent,
        )
        self._heartbeat.start()

    def _core_silent(self, reason: str) -> None:
        """The core stopped pinging (stopped, wedged): end the link as if it had closed. Aborted, not
        closed: a core that reads nothing would never take what is buffered for it."""
        if self.closed.is_set() or self._writer is None:
            return
        self._silence = reason
        self._writer.abort()

    async def _read(self, frames: FrameReader[fe_pb.CoreMessage]) -> None:
        try:
            while True:
                self.apply(await frames.read())
        except LinkClosed as exc:
            log.error("lost the core", error=self._silence or str(exc))
        except Exception:
            log.exception("applying a core message failed")
        finally:
            if self._heartbeat is not None:
                self._heartbeat.stop()
            self._end_everything(CORE_GONE)
            self.closed.set()

    def _send_outbox(self) -> None:
        message, self._outbox = self._outbox, fe_pb.FrontendMessage()
        if self._writer is None or self._writer.closed:
            return
        try:
            self._writer.write(message)
        except LinkClosed as exc:
            log.error("cannot write to the core", error=str(exc))

    def _outgoing(self) -> fe_pb.FrontendMessage:
        self._flush.request()
        return self._outbox

    # --- calls -------------------------------------------------------------------------------------

    def open_call(
        self,
        inp: client_codec.GenerateInput,
        rid: str,
        ids: list[int],
        owner: str,
        authenticated: bool = False,
        constraint_field: str = "",
    ) -> Call:
        """Register a call's samples and send its arrival; `call.verdict` resolves with the core's
        answer. `inp` is checked whole (its grammar compiled, with the backend named): the core
        takes it as it is. `constraint_field` names the client's constraint field, if any."""
        call = Call(rid=rid, owner=owner, arrived=time.monotonic(), authenticated=authenticated)
        call.verdict = asyncio.get_running_loop().create_future()
        params = inp.params
        for index in range(inp.n):
            uid = (self.link_id << UID_LINK_SHIFT) | next(self._uids)
            text = TextStream(self.tokenizer, ids, params.stop, min_new_tokens=params.min_new_tokens)
            sample = Sample(
                uid, call, index, len(ids), text, has_stops=bool(params.stop), scored=params.logprobs
            )
            call.samples.append(sample)
            self.samples[uid] = sample
        self._awaiting[call.samples[0].uid] = call
        self._outgoing().arrivals.append(_arrival(inp, call, ids, constraint_field))
        return call

    def cancel(self, call: Call, message: str) -> None:
        """The client went away: the core aborts what is left of the call; its events are dropped."""
        self.forget(call)
        if call.verdict is not None and not call.verdict.done():
            call.verdict.cancel()
        self._outgoing().aborts.add(request_id=call.rid, owner=call.owner, message=message, cancelled=True)

    def forget(self, call: Call) -> None:
        self._awaiting.pop(call.samples[0].uid, None)
        for sample in call.samples:
            sample.done = True
            self.samples.pop(sample.uid, None)

    async def abort(self, request_id: str, owner: str) -> bool:
        """An Abort call: whether the core found a live request of this owner by that id."""
        query_id = next(self._query_ids)
        self._outgoing().aborts.add(
            request_id=request_id, owner=owner, message="aborted by an Abort call", query_id=query_id
        )
        return (await self._reply(query_id)).abort.found

    async def server_info(self) -> gen_pb.ServerInfo:
        query_id = next(self._query_ids)
        self._outgoing().queries.add(query_id=query_id).server_info.SetInParent()
        return (await self._reply(query_id)).server_info

    async def _reply(self, query_id: int) -> fe_pb.Reply:
        if self.closed.is_set():
            raise LinkClosed(CORE_GONE)
        future: asyncio.Future[fe_pb.Reply] = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future
        try:
            return await future
        finally:
            self._queries.pop(query_id, None)

    # --- what the core says ------------------------------------------------------------------------

    def apply(self, msg: fe_pb.CoreMessage) -> None:
        if msg.HasField("state"):
            state = msg.state
            self.state = CoreState(state.workers, state.max_context, state.vocab_size, state.draining)
            for callback in self.on_state:
                callback(self.state)
        for verdict in msg.verdicts:
            self._verdict(verdict)
        for admission in msg.admissions:
            sample = self.samples.get(admission.uid)
            if sample is not None and sample.admitted is None:
                sample.admitted, sample.cached_tokens = admission.admitted, admission.cached_tokens
                sample.worker = admission.worker
        for scoring in msg.prompt_scores:
            self._prompt_scores(scoring)
        if msg.token_uids:
            scores = None
            if msg.scores:
                at = np.frombuffer(msg.scored_tokens, dtype="<u4").tolist()
                scores = dict(zip(at, msg.scores, strict=True))
            self._tokens(msg.token_uids, msg.token_ids, scores)
        for finished in msg.finished:
            self._finished(finished)
        for reply in msg.replies:
            future = self._queries.get(reply.query_id)
            if future is not None and not future.done():
                future.set_result(reply)

    def _verdict(self, verdict: fe_pb.Verdict) -> None:
        call = self._awaiting.pop(verdict.uid, None)
        if call is None or call.verdict is None or call.verdict.done():
            return
        if verdict.code != grpc.StatusCode.OK.value[0]:
            self.forget(call)
            call.retry_after_s = verdict.retry_after_s
        call.verdict.set_result((verdict.code, verdict.message))

    def _prompt_scores(self, msg: fe_pb.LinkPromptScores) -> None:
        """A call's prompt log probabilities, with each position's texts, before its first chunk."""
        sample = self.samples.get(msg.uid)
        if sample is None or sample.done:
            return
        positions = list(msg.positions)
        for position in positions:
            self._add_texts(position)
        ids = [p.token_id for p in positions]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        prompt = gen_pb.PromptLogprobs(start=msg.start, positions=positions, text=text)
        sample.call.post(Prompt(prompt))

    def _add_texts(self, score: gen_pb.TokenLogprob) -> None:
        """Each token's text decoded alone (special tokens kept), for clients that show tokens."""
        decode = self.tokenizer.decode
        score.token = decode((score.token_id,), skip_special_tokens=False)
        score.top_tokens.extend(decode((i,), skip_special_tokens=False) for i in score.top_ids)

    def _tokens(
        self, uid_bytes: bytes, token_bytes: bytes, scores: dict[int, gen_pb.TokenLogprob] | None = None
    ) -> None:
        uids = np.frombuffer(uid_bytes, dtype="<u8").tolist()
        tokens = np.frombuffer(token_bytes, dtype="<i4").tolist()
        samples, touched = self.samples, {}
        for k, (uid, token) in enumerate(zip(uids, tokens, strict=True)):
            sample = samples.get(uid)
            if sample is None or sample.done:
                continue  # ended here already (a stop string, a cancelled call): discarded
            score = None
            if scores is not None and sample.scored:
                score = scores.get(k)
                if score is not None:
                    self._add_texts(score)
            stop = sample.receive(token, score)
            if stop is not None:
                self._stopped(sample, stop)
            else:
                touched[uid] = sample
        interval = self.config.stream_interval
        for sample in touched.values():
            if not sample.done and sample.message_due(interval):
                sample.call.mark_due(sample)

    def take(self, call: Call) -> list[Event]:
        """What the call's handler sends now, in order: its posted events, then a chunk of every
        sample whose message is due, with all the ids it received so far."""
        events = list(call.events)
        call.events.clear()
        for sample in call.due:
            sample.queued = False
            if sample.done:
                continue  # its last chunk went with its Done
            last, first = sample.last_message, sample.first_token
            chunk = sample.flush()
            if chunk is not None:
                _observe_message(sample, chunk, last, first)
                events.append(chunk)
        call.due.clear()
        return events

    def _stopped(self, sample: Sample, stop: str) -> None:
        """A stop string ended the sample here; the core finishes it one step late."""
        self._outgoing().stops.add(uid=sample.uid, stop=stop)
        self._end(sample, FinishReason.stop(f"stop string {stop!r}"))

    def _finished(self, msg: fe_pb.LinkFinished) -> None:
        sample = self.samples.get(msg.uid)
        if sample is None or sample.done:
            return
        if not sample.admitted:
            sample.cached_tokens = msg.cached_tokens
        code = AbortCode(msg.code) if msg.code else None
        self._end(sample, FinishReason(FinishKind(msg.kind), msg.message, code))

    def _end(self, sample: Sample, reason: FinishReason) -> None:
        last, first = sample.last_message, sample.first_token
        events = sample.finish(reason)
        for event in events:
            if isinstance(event, Chunk):
                _observe_message(sample, event, last, first)
            sample.call.post(event)
        metrics.E2E_LATENCY.labels(sample.worker).observe(time.monotonic() - sample.call.arrived)
        self.samples.pop(sample.uid, None)

    def _end_everything(self, message: str) -> None:
        for call in {id(s.call): s.call for s in self.samples.values()}.values():
            if call.verdict is not None and not call.verdict.done():
                call.verdict.set_result((grpc.StatusCode.UNAVAILABLE.value[0], message))
            call.post(Lost(message))
        self.samples.clear()
        for future in self._queries.values():
            if not future.done():
                future.set_exception(LinkClosed(message))


def _observe_message(sample: Sample, chunk: Chunk, last: float, first: float | None) -> None:
    """TTFT at a sample's first message; the inter-token latency of later messages, per token."""
    now = sample.last_message
    if first is None:
        metrics.TTFT.labels(sample.worker).observe(now - sample.call.arrived)
    elif chunk.token_ids:
        if sample.itl is None:
            sample.itl = metrics.ITL.labels(sample.worker)
        sample.itl.observe((now - last) / len(chunk.token_ids))
        metrics.TOKENS_PER_MESSAGE.observe(len(chunk.token_ids))


def _arrival(
    inp: client_codec.GenerateInput, call: Call, ids: list[int], constraint_field: str
) -> fe_pb.Arrival:
    params = inp.params
    return fe_pb.Arrival(
        request_id=call.rid,
        uids=[s.uid for s in call.samples],
        input_ids=np.asarray(ids, dtype="<i4").tobytes(),
        params=link_params.to_proto(params),
        constraint_field=constraint_field,
        routing_key=params.routing_key,
        has_priority=params.priority is not None,
        priority=params.priority or 0,
        owner=call.owner,
        arrived=call.arrived,
        prompt_field="text" if inp.text is not None else "input_ids",
        tenant=params.tenant,
        ttft_slo_ms=params.ttft_slo_ms,
        tpot_slo_ms=params.tpot_slo_ms,
        authenticated=call.authenticated,
    )
