"""The core's end of every frontend link: arrivals, aborts and stops in; verdicts, token batches and
finishes out, one CoreMessage per link per event-loop turn.

Engines publish here as they apply results (`Publisher`); what one loop turn produced for a
frontend, across every engine, leaves as one message. A frontend whose link breaks has died: every
request it submitted is aborted and its KV freed in the next plan. A frontend that stops answering
its heartbeat (core/heartbeat.py) is killed (`on_stalled`: the supervisor SIGKILLs it, then restarts
it) and its link closed here, with the same consequences.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import numpy as np
import structlog

from control_plane import link_params
from control_plane.config import ControlConfig
from control_plane.core.heartbeat import Silence
from control_plane.core.inbox import Arrival, LiveSample, Verdict
from control_plane.link import (
    DRAINING,
    UID_LINK_SHIFT,
    FrameReader,
    FrameWriter,
    LinkClosed,
    TurnFlush,
    link_of,
)
from control_plane.request import AbortCode, FinishReason, RequestParams
from control_plane.scheduler.records import PromptScoring
from control_plane.tenants.book import TenantBook
from control_plane.tenants.table import TenantRefused
from protos.stepwise.v1 import frontend_pb2 as fe_pb
from protos.stepwise.v1 import reports_pb2 as reports_pb
from protos.worker import TokenLogprobs

if TYPE_CHECKING:
    from control_plane.core.engine import Engine
    from control_plane.core.fleet import Router
    from control_plane.core.grammar_gate import GrammarGate

log = structlog.get_logger("stepwise.hub")

FRONTEND_GONE = "its frontend went away"
NO_WORKER = "no worker can take requests (none is attached, or every one is leaving)"
# A frontend gets at most one message per this interval: steps of several workers that end close
# together leave as one message (one write, one wake-up of the frontend) for at most this much delay.
FLUSH_INTERVAL_S = 0.002
_STATUS = {
    Verdict.ACCEPTED: grpc.StatusCode.OK,
    Verdict.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Verdict.SLO_UNMEETABLE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Verdict.REJECTED: grpc.StatusCode.UNAVAILABLE,
    Verdict.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Verdict.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    Verdict.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Verdict.INTERNAL: grpc.StatusCode.INTERNAL,
    Verdict.OVER_QUOTA: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Verdict.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
}

# The `quota` label of a call refused after the quotas passed it: the field a refusal names where
# it names one (as a quota refusal names its quota), else the verdict.
_REFUSED_BY = {Verdict.SLO_UNMEETABLE: "ttft_slo_ms"}


@dataclass(slots=True)
class _Outbox:
    """What one frontend is owed at the end of this loop turn."""

    message: fe_pb.CoreMessage = field(default_factory=fe_pb.CoreMessage)
    uids: list[np.ndarray] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    # Tokens above so far, and the indices among them of those with logprobs (in message.scores).
    count: int = 0
    scored: list[int] = field(default_factory=list)

    def score(self, token_ids: np.ndarray, scores: tuple[tuple[int, TokenLogprobs], ...]) -> None:
        """Logprobs of tokens about to be appended (`scores` index into `token_ids`)."""
        for k, lp in scores:
            self.scored.append(self.count + k)
            _fill_score(self.message.scores.add(token_id=int(token_ids[k])), lp)

    def take(self) -> fe_pb.CoreMessage:
        message = self.message
        if self.uids:
            message.token_uids = np.concatenate(self.uids).astype("<u8", copy=False).tobytes()
            message.token_ids = np.concatenate(self.tokens).astype("<i4", copy=False).tobytes()
        if self.scored:
            message.scored_tokens = np.asarray(self.scored, dtype="<u4").tobytes()
        self.message, self.uids, self.tokens = fe_pb.CoreMessage(), [], []
        self.count, self.scored = 0, []
        return message


def _fill_score(msg: reports_pb.TokenLogprob, lp: TokenLogprobs) -> None:
    msg.logprob = lp.logprob
    msg.top_ids.extend(lp.top_ids)
    msg.top_logprobs.extend(lp.top_logprobs)
    msg.ids_logprobs.extend(lp.ids_logprobs)


class _Link:
    """One connected frontend."""

    def __init__(
        self, link_id: int, hello: fe_pb.FrontendHello, writer: FrameWriter, silence: Silence
    ) -> None:
        self.link_id = link_id
        self.index = hello.index
        self.pid = hello.pid
        self.writer = writer
        self.outbox = _Outbox()
        self.flush = TurnFlush(self._send, FLUSH_INTERVAL_S)
        self.silence = silence
        # The heartbeat connection, once the frontend has opened it.
        self.heartbeat: FrameWriter | None = None
        # Found stalled: being killed, its link closing.
        self.stalled = False

    def close(self) -> None:
        """Abort both connections (a stalled frontend reads nothing: closing would wait on it)."""
        self.writer.abort()
        if self.heartbeat is not None:
            self.heartbeat.abort()

    def outgoing(self) -> _Outbox:
        self.flush.request()
        return self.outbox

    def _send(self) -> None:
        message = self.outbox.take()
        if self.writer.closed:
            return
        try:
            self.writer.write(message)
        except LinkClosed as exc:
            log.error("cannot write to a frontend", frontend=self.index, error=str(exc))


class FrontendHub:
    """Accepts frontend links on a Unix socket and routes between them and the engines."""

    def __init__(
        self,
        config: ControlConfig,
        router: Router[Engine],
        server_info: Callable[[], reports_pb.ServerInfo],
        on_stalled: Callable[[int, int], None] | None = None,
    ) -> None:
        self.config = config
        self.router = router
        self.server_info = server_info
        # Called with a stalled frontend's index and pid (the supervisor kills it).
        self.on_stalled = on_stalled
        # The control plane drains: arrivals are refused (UNAVAILABLE, retry elsewhere).
        self.draining = False
        self.links: dict[int, _Link] = {}
        # Each attached worker's grammar gate, by its engine (the server adds and removes them).
        self.grammar_gates: dict[Engine, GrammarGate] = {}
        self._link_ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        # Called with the frontend index and pid when a frontend connects (the supervisor waits).
        self.connected: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        # Tenants and their quotas (--tenants); None: every request passes as before.
        self.tenants: TenantBook | None = None

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path)
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        for link in self.links.values():
            link.writer.close()
            if link.heartbeat is not None:
                link.heartbeat.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    # --- the Publisher the engines call ---------------------------------------------------------

    def verdict(self, uid: int, verdict: Verdict, message: str = "", retry_after_s: float = 0.0) -> None:
        if self.tenants is not None:
            if verdict is Verdict.ACCEPTED:
                self.tenants.accepted(uid)
            else:
                self.tenants.refused(uid, _REFUSED_BY.get(verdict, verdict.value))
        link = self.links.get(link_of(uid))
        if link is not None:
            link.outgoing().message.verdicts.add(
                uid=uid, code=_STATUS[verdict].value[0], message=message, retry_after_s=retry_after_s
            )

    def admitted(self, uid: int, cached_tokens: int, at: float, worker: str) -> None:
        if self.tenants is not None:
            self.tenants.admitted(uid)
        link = self.links.get(link_of(uid))
        if link is not None:
            link.outgoing().message.admissions.add(
                uid=uid, cached_tokens=cached_tokens, admitted=at, worker=worker
            )

    def tokens(
        self, uids: np.ndarray, token_ids: np.ndarray, scores: tuple[tuple[int, TokenLogprobs], ...] = ()
    ) -> None:
        """A step's tokens (uid i produced token i), split by the frontend that owns each uid, with
        the logprobs of those that have them (`scores` index into the tokens)."""
        if not len(uids):
            return
        if self.tenants is not None:
            self.tenants.tokens(uids.tolist(), time.monotonic())
        owners = uids >> np.uint64(UID_LINK_SHIFT)
        first = int(owners[0])
        if len(self.links) == 1 or bool((owners == first).all()):
            self._tokens_to(first, uids, token_ids, scores)
            return
        for link_id in np.unique(owners).tolist():
            mask = owners == link_id
            local = np.cumsum(mask) - 1
            mine = tuple((int(local[k]), lp) for k, lp in scores if mask[k])
            self._tokens_to(int(link_id), uids[mask], token_ids[mask], mine)

    def _tokens_to(
        self,
        link_id: int,
        uids: np.ndarray,
        token_ids: np.ndarray,
        scores: tuple[tuple[int, TokenLogprobs], ...],
    ) -> None:
        link = self.links.get(link_id)
        if link is not None:
            outbox = link.outgoing()
            if scores:
                outbox.score(token_ids, scores)
            outbox.uids.append(uids)
            outbox.tokens.append(token_ids)
            outbox.count += len(token_ids)

    def prompt_scores(self, scoring: PromptScoring) -> None:
        link = self.links.get(link_of(scoring.uid))
        if link is None:
            return
        msg = link.outgoing().message.prompt_scores.add(uid=scoring.uid, start=scoring.start)
        prompt, start = scoring.prompt, scoring.start
        msg.positions.add(token_id=prompt[start])
        for j, row in enumerate(scoring.rows):
            _fill_score(msg.positions.add(token_id=prompt[start + 1 + j]), row)

    def finished(self, uid: int, reason: FinishReason, cached_tokens: int) -> None:
        if self.tenants is not None:
            self.tenants.ended(uid)
        link = self.links.get(link_of(uid))
        if link is not None:
            link.outgoing().message.finished.add(
                uid=uid,
                kind=reason.kind.value,
                message=reason.message,
                code=reason.code.value if reason.code is not None else "",
                cached_tokens=cached_tokens,
            )

    def broadcast_state(self) -> None:
        state = self._state()
        for link in self.links.values():
            link.outgoing().message.state.CopyFrom(state)

    def _state(self) -> fe_pb.CoreState:
        limits = [e.limits for e in self.router.engines.values()]
        return fe_pb.CoreState(
            workers=len(self.router.available()),
            max_context=min((lim.max_context for lim in limits), default=0),
            vocab_size=min((lim.vocab_size for lim in limits), default=0),
            draining=self.draining,
        )

    # --- links -------------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = FrameReader(reader, fe_pb.FrontendMessage)
        out = FrameWriter(writer)
        try:
            hello = await frames.read()
        except LinkClosed:
            out.close()
            return
        if hello.hello.heartbeat_of:
            await self._serve_heartbeat(hello.hello, frames, out)
            return
        silence = Silence(self.config.frontend_heartbeat_interval_s, self.config.frontend_heartbeat_timeout_s)
        link = _Link(next(self._link_ids), hello.hello, out, silence)
        self.links[link.link_id] = link
        out.write(fe_pb.CoreMessage(welcome=fe_pb.CoreWelcome(link_id=link.link_id), state=self._state()))
        self.connected.put_nowait((hello.hello.index, hello.hello.pid))
        log.info("frontend connected", frontend=link.index, pid=hello.hello.pid, link=link.link_id)
        try:
            while True:
                self._apply(link, await frames.read())
        except LinkClosed as exc:
            log.info("frontend link closed", frontend=link.index, reason=str(exc))
        finally:
            del self.links[link.link_id]
            out.close()
            if link.heartbeat is not None:
                link.heartbeat.close()
            self._abandoned(link)

    async def _serve_heartbeat(
        self, hello: fe_pb.FrontendHello, frames: FrameReader[fe_pb.FrontendMessage], out: FrameWriter
    ) -> None:
        """A frontend's heartbeat connection: its pongs, until it or its link closes."""
        link = self.links.get(hello.heartbeat_of)
        if link is None or link.heartbeat is not None or link.pid != hello.pid:
            log.error("a heartbeat connection for no link of that frontend", link=hello.heartbeat_of)
            out.close()
            return
        link.heartbeat = out
        try:
            while True:
                message = await frames.read()
                link.silence.pong(message.pong.seq, message.pong.loop_silent_s)
        except LinkClosed as exc:
            # The link goes on without it; the silence that follows is what counts.
            log.info("frontend heartbeat closed", frontend=link.index, reason=str(exc))
        finally:
            out.close()

    async def _beat(self) -> None:
        """Ping every frontend once per heartbeat interval; kill those that went silent."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.frontend_heartbeat_interval_s)
            now = loop.time()
            for link in [link for link in self.links.values() if not link.stalled]:
                try:
                    self._beat_one(link, now)
                except Exception:  # one frontend's trouble must not end every frontend's heartbeat
                    log.exception("heartbeat failed", frontend=link.index)

    def _beat_one(self, link: _Link, now: float) -> None:
        ping = fe_pb.CoreMessage(ping=fe_pb.Ping(seq=link.silence.tick(now)))
        if link.heartbeat is not None and not link.heartbeat.closed:
            with contextlib.suppress(LinkClosed):
                link.heartbeat.write(ping)
        why = link.silence.stalled()
        if why:
            self._stalled(link, why)

    def _stalled(self, link: _Link, why: str) -> None:
        """Kill the frontend (its clients' connections break: UNAVAILABLE, as for any dead frontend)
        and close its link here, which aborts its requests (`_abandoned`) whether or not it dies."""
        log.error("frontend stalled: killing it", frontend=link.index, pid=link.pid, reason=why)
        link.stalled = True
        if self.on_stalled is not None:
            self.on_stalled(link.index, link.pid)
        link.close()

    def _abandoned(self, link: _Link) -> None:
        """The frontend died: its clients are gone with it, so their requests are aborted."""
        aborted = sum(e.abort_link(link.link_id, FRONTEND_GONE) for e in self.router.engines.values())
        aborted += sum(g.abort_link(link.link_id, link_of) for g in self.grammar_gates.values())
        if aborted:
            log.warning("frontend lost: its requests are aborted", frontend=link.index, aborted=aborted)

    def _apply(self, link: _Link, msg: fe_pb.FrontendMessage) -> None:
        for arrival in msg.arrivals:
            self._arrive(link, arrival)
        for abort in msg.aborts:
            self._abort(link, abort)
        for stop in msg.stops:
            self._stop(stop)
        for query in msg.queries:
            reply = link.outgoing().message.replies.add(query_id=query.query_id)
            reply.server_info.CopyFrom(self.server_info())

    def _arrive(self, link: _Link, msg: fe_pb.Arrival) -> None:
        uids = list(msg.uids)
        if not uids or any(link_of(uid) != link.link_id for uid in uids):
            log.error("frontend sent an arrival with foreign uids", frontend=link.index)
            return
        refusal = self._refusal(msg)
        if refusal is not None:
            self.verdict(uids[0], *refusal)
            return
        ids = np.frombuffer(msg.input_ids, dtype="<i4")
        engine = self.router.pick(msg.routing_key, ids)
        if engine is None:
            self.verdict(uids[0], Verdict.UNAVAILABLE, NO_WORKER)
            return
        error = engine.scheduler.input_length_error(len(ids))
        if error and not self.config.scheduler.allow_auto_truncate:
            self.verdict(uids[0], Verdict.INVALID, f"{msg.prompt_field or 'prompt'}: {error}")
            return
        params = self._tenancy(msg, link_params.from_arrival(msg))
        if params is None:
            return
        grammar = params.sampler.grammar
        if grammar is not None and grammar.backend not in engine.limits.grammar_backends:
            message = f"worker {engine.worker} cannot run the {grammar.backend} grammar backend"
            self.verdict(uids[0], Verdict.INVALID, f"{msg.constraint_field}: {message}")
            return
        rids = [msg.request_id] if len(uids) == 1 else [f"{msg.request_id}/{i}" for i in range(len(uids))]
        samples = tuple(
            LiveSample(rid, uid, msg.request_id, msg.owner, msg.arrived)
            for rid, uid in zip(rids, uids, strict=True)
        )
        if not self._within_quota(params.tenant, tuple(uids), len(ids)):
            return
        arrival = Arrival(samples, ids.tolist(), params)
        gate = self.grammar_gates.get(engine)
        if gate is not None:
            gate.submit(arrival)
        else:
            engine.submit(arrival)

    def _tenancy(self, msg: fe_pb.Arrival, params: RequestParams) -> RequestParams | None:
        """The request's tenant; None when its key may not name the tenant it names (answered here).
        Its tenant's latency defaults are the scheduler's to apply (SchedulerConfig.tenant_slo)."""
        if self.tenants is None:
            tenant = msg.tenant or (msg.owner if msg.authenticated else "")
            return dataclasses.replace(params, tenant=tenant)
        table = self.tenants.table
        try:
            tenant = table.resolve(msg.owner, msg.authenticated, msg.tenant)
        except TenantRefused as exc:
            self.verdict(msg.uids[0], Verdict.FORBIDDEN, str(exc))
            return None
        return dataclasses.replace(params, tenant=tenant)

    def _within_quota(self, tenant: str, uids: tuple[int, ...], prompt_tokens: int) -> bool:
        if self.tenants is None:
            return True
        refusal = self.tenants.arrive(tenant, uids, prompt_tokens, time.monotonic())
        if refusal is None:
            return True
        message = f"{refusal.field}: {refusal.message}; retry in {math.ceil(refusal.retry_after_s)} s"
        self.verdict(uids[0], Verdict.OVER_QUOTA, message, refusal.retry_after_s)
        return False

    def _refusal(self, msg: fe_pb.Arrival) -> tuple[Verdict, str] | None:
        if self.draining:
            return Verdict.UNAVAILABLE, DRAINING
        if self.router.find(msg.request_id) is not None:
            return Verdict.DUPLICATE, f"request_id: {msg.request_id!r} is in use"
        return None

    def _abort(self, link: _Link, msg: fe_pb.LinkAbort) -> None:
        code = AbortCode.CANCELLED
        engine = self.router.find(msg.request_id)
        found = False
        held = next((g for g in self.grammar_gates.values() if g.holds(msg.request_id, msg.owner)), None)
        if held is not None:  # still waiting for its grammar: it never reaches a scheduler
            found = held.abort(msg.request_id)
        # Someone else's request is reported as not found: its id tells the caller nothing.
        if engine is not None and engine.owner_of(msg.request_id) == msg.owner:
            found = engine.abort(msg.request_id, msg.message or "aborted", code)
        if not msg.cancelled:
            reply = link.outgoing().message.replies.add(query_id=msg.query_id)
            reply.abort.found = found

    def _stop(self, msg: fe_pb.LinkStop) -> None:
        reason = FinishReason.stop(f"stop string {msg.stop!r}")
        for engine in self.router.engines.values():
            if engine.stop_sample(msg.uid, reason):
                return
