"""One step loop per worker: plan, send, receive, apply, publish.

The engine owns a Scheduler (pure) and a WorkerChannel (the wire). Arrivals and aborts are queued
in an inbox and applied at the top of each iteration, so the scheduler sees them at a well-defined
step (what the recorder stamps). Detokenization and stop strings happen here, on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from control_plane import metrics
from control_plane.cache.invariants import InvariantError, PoolCheck, check_pool_invariants
from control_plane.config import ControlConfig
from control_plane.record.recorder import close_recording, make_scheduler
from control_plane.request import AbortCode, FinishReason, Request, RequestParams
from control_plane.scheduler.plan import StepPlan, StepResult, WorkerLimits
from control_plane.scheduler.scheduler import QueueFull, RequestRejected, RequestUpdate
from control_plane.step_log import StepLog
from control_plane.timeouts import Timeouts
from control_plane.tokenizer import TextStream, Tokenizer
from control_plane.worker_checks import WorkerFault, check_result

log = structlog.get_logger("stepwise.engine")

INTERNAL_ERROR = "internal error in the control plane (logged); the request could not be continued"
# A request live during this many faults of our own is ended rather than tried again.
MAX_FAULTS_PER_REQUEST = 2
# This many faults in a row, with no step completed between them, and the worker is given up.
MAX_CONSECUTIVE_FAULTS = 3
# Work units of the idle pool check per slice (about a millisecond), between which the loop yields.
IDLE_CHECK_BUDGET = 4096
SEED_SPACE = 1 << 64


class WorkerGone(Exception):
    """The worker's stream ended or broke."""


class WorkerChannel(Protocol):
    async def step(self, plan: StepPlan) -> StepResult: ...

    async def close(self, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, slots=True)
class Done:
    index: int
    reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_s: float
    ttft_s: float
    total_s: float


Event = Chunk | Done


@dataclass(slots=True)
class RequestStream:
    """The client side of one request (one sample): text stream, timestamps, where events go."""

    rid: str
    # The Generate call this sample belongs to (== rid when n == 1).
    call: str
    index: int
    prompt_len: int
    text: TextStream
    # Shared by the samples of one Generate call.
    events: asyncio.Queue[Event]
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    last_token: float = 0.0
    completion_tokens: int = 0
    done: bool = False
    # Faults of our own this request lived through (see Engine._recover).
    faults: int = 0
    # Who submitted it (an API key's id, or the client's connection); only they may abort it.
    owner: str = ""


@dataclass(slots=True)
class Submission:
    """One Generate call: its samples' request ids and the queue their events arrive on."""

    rid: str
    rids: list[str]
    events: asyncio.Queue[Event]
    # Resolves once the scheduler has taken (or refused, with QueueFull etc.) every sample.
    accepted: asyncio.Future[None]


@dataclass(frozen=True, slots=True)
class _Arrival:
    submission: Submission
    streams: list[RequestStream]
    input_ids: list[int]
    params: list[RequestParams]


@dataclass(frozen=True, slots=True)
class _Abort:
    rid: str
    reason: FinishReason


@dataclass(frozen=True, slots=True)
class Orphan:
    """A live request of a lost worker, to continue on another one from where it stopped."""

    stream: RequestStream
    # The prompt plus every token already streamed: the next token continues the generation.
    input_ids: list[int]
    # The client's parameters with max_new_tokens reduced by what was generated.
    params: RequestParams


class Engine:
    """Drives one worker. All scheduler calls happen inside `run`, one at a time."""

    def __init__(
        self,
        config: ControlConfig,
        limits: WorkerLimits,
        tokenizer: Tokenizer,
        channel: WorkerChannel,
    ) -> None:
        self.config = config
        self.limits = limits
        self.tokenizer = tokenizer
        self.channel = channel
        # A RecordingScheduler under --record DIR: every call below is also written down.
        self.scheduler = make_scheduler(config, limits)
        self.streams: dict[str, RequestStream] = {}
        # Generate call id -> its samples' request ids.
        self._groups: dict[str, list[str]] = {}
        self._inbox: list[_Arrival | _Abort | Orphan] = []
        # Called when the worker is lost: returns the engine that takes over its requests, if any.
        self.successor: Callable[[Engine], Engine | None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        # Why the worker was dropped for breaking the protocol (or hanging); None while it behaves.
        self.fault: str | None = None
        # The next plan tells the worker to forget everything (after _recover).
        self._reset_worker = False
        self._faults_in_a_row = 0
        # The pool has changed since its last complete idle check.
        self._pool_dirty = True
        self.worker = limits.worker_id
        metrics.register_worker(self.worker)
        self.log = log.bind(worker=limits.worker_id)
        # Books vs. the worker's report (checked every step).
        self.kv_mismatches = 0
        self.reported_kv = (0, 0)
        self.steps = 0
        self.step_log = StepLog(self.worker, config.decode_log_interval, self.log)
        self.timeouts = Timeouts(config.waiting_timeout_s, config.running_timeout_s, self._first_forward)

    # --- called from request handlers -----------------------------------------------------------

    def submit(
        self, rid: str, input_ids: list[int], params: RequestParams, n: int = 1, owner: str = ""
    ) -> Submission:
        """Queue an arrival of n samples (request ids `rid` when n == 1, else `rid/0` ... `rid/n-1`,
        grouped so they are never partially retracted). `accepted` resolves, or raises QueueFull /
        RequestRejected / ValueError, once the scheduler has seen it."""
        rids = [rid] if n == 1 else [f"{rid}/{i}" for i in range(n)]
        if any(r in self.streams for r in [rid, *rids]) or rid in self._groups:
            raise ValueError(f"request_id {rid!r} is already in use")
        events: asyncio.Queue[Event] = asyncio.Queue()
        submission = Submission(rid, rids, events, asyncio.get_running_loop().create_future())
        streams = [
            RequestStream(
                r,
                rid,
                i,
                len(input_ids),
                TextStream(self.tokenizer, input_ids, params.stop, min_new_tokens=params.min_new_tokens),
                events,
                owner=owner,
            )
            for i, r in enumerate(rids)
        ]
        for stream in streams:
            self.streams[stream.rid] = stream
        self._groups[rid] = rids
        self._inbox.append(
            _Arrival(submission, streams, input_ids, [_sample_params(params, i, n, rid) for i in range(n)])
        )
        self._wake.set()
        return submission

    def abort(self, rid: str, message: str, code: AbortCode = AbortCode.CANCELLED) -> bool:
        """Abort a Generate call (all its samples) or one sample by its own id."""
        rids = self._groups.get(rid, [rid] if rid in self.streams else [])
        live = [r for r in rids if r in self.streams]
        for r in live:
            self._inbox.append(_Abort(r, FinishReason.abort(message, code)))
        self._wake.set()
        return bool(live)

    def _first_forward(self, rid: str) -> float | None:
        stream = self.streams.get(rid)
        return stream.admitted if stream is not None else None

    def knows(self, rid: str) -> bool:
        return rid in self._groups or rid in self.streams

    def owner_of(self, rid: str) -> str | None:
        """Who submitted the live Generate call (or sample) `rid`; None when it is not live here."""
        rids = self._groups.get(rid, [rid])
        stream = next((self.streams[r] for r in rids if r in self.streams), None)
        return stream.owner if stream is not None else None

    def load(self) -> tuple[int, int]:
        """(queued, running) for routing and server info."""
        sched = self.scheduler
        arriving = sum(len(m.streams) for m in self._inbox if isinstance(m, _Arrival))
        return len(sched.waiting) + arriving, len(sched.running)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # --- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Step until stopped or the worker is gone; every live request ends with a finish reason.

        Faults are contained: a worker that breaks the protocol or hangs is dropped (`fault` says
        why) and its requests continue elsewhere; an exception of our own restarts this worker's
        scheduler (`_recover`) and the loop goes on serving.
        """
        try:
            while not self._stopping:
                try:
                    await self._iteration()
                except (WorkerGone, WorkerFault):
                    raise
                except Exception as exc:
                    if isinstance(exc, InvariantError) and self.config.scheduler.strict_invariants:
                        raise  # --strict-invariants (tests): a broken pool ends the run loudly
                    self._recover(exc)
        except WorkerFault as exc:
            self.fault = str(exc)
            self.log.error("worker dropped", error=self.fault)
            self._hand_over(self.fault)
        except WorkerGone as exc:
            self._hand_over(str(exc))
        except asyncio.CancelledError:
            # gRPC cancels the Connect handler when the worker's connection drops: that is a lost
            # worker too, unless the control plane itself is stopping.
            if not self._stopping:
                self._hand_over("the worker's stream was cancelled")
            raise
        finally:
            self._release_waiting_arrivals()
            self._abort_all("control plane is shutting down")
            close_recording(self.scheduler)
            with contextlib.suppress(Exception):
                await self.channel.close("control plane is shutting down")

    async def _iteration(self) -> None:
        self._drain_inbox()
        if self.timeouts.enabled:
            self.timeouts.check(self.scheduler, time.monotonic())
        plan = self.scheduler.next_plan()
        if self.timeouts.enabled:
            self.timeouts.note_waiting(self.scheduler, time.monotonic())
        self._publish()
        if plan is None:
            await self._idle()
            return
        await self._step(plan)

    async def _idle(self) -> None:
        if self.scheduler.is_idle:
            self.scheduler.on_idle()
            await self._check_pool_while_idle()
        self._wake.clear()
        if self._inbox or self._stopping:
            return
        timeout = self.timeouts.poll_s() if self.streams else None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _step(self, plan: StepPlan) -> None:
        sched = self.scheduler
        stats = sched.last_stats
        assert stats is not None
        self._note_admissions(plan)
        expected = (sched.live_handles(), sched.live_seq_slots() + len(plan.decodes))
        if self._reset_worker:
            plan, self._reset_worker = dataclasses.replace(plan, reset=True), False
        result = await self._exchange(plan)
        if result.error:
            raise WorkerGone(f"worker failed step {plan.step_id}: {result.error}")
        check_result(plan, result, self.limits.vocab_size)
        self._faults_in_a_row, self._pool_dirty = 0, True
        self._check_books(plan.step_id, expected, result)
        sched.apply_result(result)
        self._publish()
        self.steps += 1
        if self.config.scheduler.strict_invariants:
            self._check_invariants()
        self.step_log.record(plan, stats, self.scheduler)

    async def _exchange(self, plan: StepPlan) -> StepResult:
        """Send a plan and wait for its result, no longer than the plan's deadline (a hung worker)."""
        tokens = len(plan.extends.token_ids) + len(plan.decodes)
        deadline = self.config.limits.step_deadline_s(tokens)
        try:
            return await asyncio.wait_for(self.channel.step(plan), deadline)
        except TimeoutError:
            raise WorkerFault(f"no result for step {plan.step_id} within {deadline:.1f} s") from None

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, _Arrival):
                self._admit(item)
            elif isinstance(item, Orphan):
                self._admit_orphan(item)
            elif not self.scheduler.abort(item.rid, item.reason):
                self._fail_stream(item.rid, item.reason)

    def _admit(self, arrival: _Arrival) -> None:
        """Add every sample of a call, or none: a refusal withdraws the samples already queued."""
        submission = arrival.submission
        added: list[str] = []
        try:
            for stream, params in zip(arrival.streams, arrival.params, strict=True):
                self.scheduler.add_request(stream.rid, arrival.input_ids, params)
                added.append(stream.rid)
        except Exception as exc:
            if not isinstance(exc, (QueueFull, RequestRejected, ValueError)):
                self.log.exception("admission failed", rid=submission.rid)
            self._withdraw(submission, added, str(exc))
            if not submission.accepted.done():
                submission.accepted.set_exception(exc)
            return
        if submission.accepted.done():  # the client gave up before we got to it
            self._withdraw(submission, added, "cancelled by the client")
            return
        submission.accepted.set_result(None)

    def _withdraw(self, submission: Submission, added: list[str], message: str) -> None:
        for rid in added:
            self.scheduler.abort(rid, FinishReason.abort(message))
        self._forget(submission)  # their updates now find no stream and are dropped

    def _release_waiting_arrivals(self) -> None:
        """Arrivals the scheduler never saw: their calls are let through to read the abort."""
        inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, _Arrival) and not item.submission.accepted.done():
                item.submission.accepted.set_result(None)
            elif isinstance(item, Orphan):
                self.streams.setdefault(item.stream.rid, item.stream)

    # --- a lost worker's requests continue elsewhere (DESIGN.md, "The worker protocol") ----------------

    def _hand_over(self, error: str) -> None:
        """Give every live request to another worker, continuing after its last streamed token."""
        self._drain_inbox()  # arrivals not yet seen become requests too; aborts take effect
        self._publish()
        target = self.successor(self) if self.successor is not None else None
        # An idle worker that goes away (scaled down, restarted) costs nothing: a warning.
        report = self.log.error if self.streams else self.log.warning
        if target is None:
            report("worker lost", error=error, continued=0, aborted=len(self.streams))
            self._abort_all(f"worker {self.worker} disconnected ({error}) and no other worker is attached")
            return
        orphans = [
            self._orphan(req, self.streams[req.rid])
            for req in self.scheduler.live_requests()
            if req.rid in self.streams
        ]
        for orphan in orphans:
            self.streams.pop(orphan.stream.rid)
            self._groups.pop(orphan.stream.call, None)
        report("worker lost", error=error, continued=len(orphans), on=target.worker)
        target.adopt(orphans)

    @staticmethod
    def _orphan(req: Request, stream: RequestStream) -> Orphan:
        """The request as a new arrival that continues right after the last token its client got."""
        streamed = req.output_ids[: stream.completion_tokens]
        params = dataclasses.replace(
            req.params, min_new_tokens=max(0, req.params.min_new_tokens - len(streamed))
        )
        if params.max_new_tokens is not None:
            params = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(streamed))
        return Orphan(stream, req.origin_input_ids + streamed, params)

    # --- a fault of our own: start this worker over (STYLE: faults are contained where they arise) ---

    def _recover(self, exc: Exception) -> None:
        """Log the fault, replace the scheduler, and continue every live request on the fresh one.

        The old scheduler's state may be inconsistent, so nothing of it is kept but each request's
        prompt and streamed tokens; the worker is told to forget everything with the next plan. A
        request that lives through MAX_FAULTS_PER_REQUEST faults ends with an abort instead, so a
        request that triggers a bug cannot loop.
        """
        self.log.error("step loop fault: restarting this worker's scheduler", exc_info=exc)
        self._faults_in_a_row += 1
        if self._faults_in_a_row >= MAX_CONSECUTIVE_FAULTS:
            raise WorkerGone(
                f"the step loop failed {self._faults_in_a_row} times in a row ({exc!r})"
            ) from exc
        old = self.scheduler
        orphans = self._salvage()
        with contextlib.suppress(Exception):
            close_recording(old)
        self.scheduler = make_scheduler(self.config, self.limits)
        self._reset_worker, self._pool_dirty = True, True
        self._inbox.extend(orphans)

    def _salvage(self) -> list[Orphan]:
        with contextlib.suppress(Exception):
            self._publish()
        try:
            live = {req.rid: req for req in self.scheduler.live_requests()}
        except Exception:
            live = {}
        waiting = {s.rid for item in self._inbox if isinstance(item, _Arrival) for s in item.streams}
        waiting |= {item.stream.rid for item in self._inbox if isinstance(item, Orphan)}
        orphans = []
        for stream in list(self.streams.values()):
            if stream.rid in waiting or stream.done:
                continue
            stream.faults += 1
            req = live.get(stream.rid)
            if req is None or stream.faults >= MAX_FAULTS_PER_REQUEST:
                self._finish_stream(stream, FinishReason.abort(INTERNAL_ERROR))
            else:
                orphans.append(self._orphan(req, stream))
        return orphans

    def adopt(self, orphans: list[Orphan]) -> None:
        """Take over requests of a lost worker: their streams continue here."""
        for orphan in orphans:
            stream = orphan.stream
            self.streams[stream.rid] = stream
            self._groups.setdefault(stream.call, []).append(stream.rid)
            self._inbox.append(orphan)
        self._wake.set()

    def _admit_orphan(self, orphan: Orphan) -> None:
        try:
            self.scheduler.add_request(orphan.stream.rid, orphan.input_ids, orphan.params)
        except (QueueFull, RequestRejected, ValueError) as exc:
            message = f"its worker was lost and {self.worker} could not take it over: {exc}"
            self._finish_stream(orphan.stream, FinishReason.abort(message))

    def _forget(self, submission: Submission) -> None:
        for rid in submission.rids:
            self.streams.pop(rid, None)
        self._groups.pop(submission.rid, None)

    def _fail_stream(self, rid: str, reason: FinishReason) -> None:
        """An abort for a request the scheduler no longer knows (e.g. still in the inbox)."""
        stream = self.streams.get(rid)
        if stream is not None and not stream.done:
            self._finish_stream(stream, reason)

    def _note_admissions(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for seq in plan.new_seqs:
            req = self.scheduler.by_handle.get(seq.handle)
            stream = self.streams.get(req.rid) if req is not None else None
            if stream is not None and stream.admitted is None:
                stream.admitted = now
                metrics.QUEUE_TIME.labels(self.worker).observe(now - stream.arrived)

    # --- publishing -------------------------------------------------------------------------------

    def _publish(self) -> None:
        while updates := self.scheduler.take_updates():
            for update in updates:
                self._publish_one(update)

    def _publish_one(self, update: RequestUpdate) -> None:
        stream = self.streams.get(update.rid)
        if stream is None or stream.done:
            return
        try:
            self._deliver(stream, update)
        except Exception:
            # A fault in one request's text (detokenizer, stop matcher) ends that request alone.
            self.log.exception("publishing failed", rid=stream.rid)
            self.scheduler.abort(stream.rid, FinishReason.abort(INTERNAL_ERROR))
            if not stream.done:
                self._finish_stream(stream, FinishReason.abort(INTERNAL_ERROR))

    def _deliver(self, stream: RequestStream, update: RequestUpdate) -> None:
        if update.token_ids:
            self._push_tokens(stream, update.token_ids)
        if update.finished is not None:
            self._finish_stream(stream, update.finished, update.cached_tokens)

    def _push_tokens(self, stream: RequestStream, token_ids: tuple[int, ...]) -> None:
        now = time.monotonic()
        if stream.first_token is None:
            stream.first_token = now
            metrics.TTFT.labels(self.worker).observe(now - stream.arrived)
        else:
            metrics.ITL.labels(self.worker).observe(now - stream.last_token)
        stream.last_token = now
        metrics.GENERATION_TOKENS.labels(self.worker).inc(len(token_ids))
        stream.completion_tokens += len(token_ids)
        delta = stream.text.push(token_ids)
        stream.events.put_nowait(Chunk(stream.index, token_ids, delta.text))
        if delta.stop is not None:
            # Finished here; its KV is cached and its handle released in the next plan.
            self.scheduler.finish(stream.rid, FinishReason.stop(f"stop string {delta.stop!r}"))

    def _finish_stream(self, stream: RequestStream, reason: FinishReason, cached_tokens: int = 0) -> None:
        tail = stream.text.finish()
        if tail:
            stream.events.put_nowait(Chunk(stream.index, (), tail))
        now = time.monotonic()
        admitted = stream.admitted if stream.admitted is not None else now
        first = stream.first_token if stream.first_token is not None else now
        stream.events.put_nowait(
            Done(
                index=stream.index,
                reason=reason,
                prompt_tokens=stream.prompt_len,
                cached_tokens=cached_tokens,
                completion_tokens=stream.completion_tokens,
                queue_s=admitted - stream.arrived,
                ttft_s=first - stream.arrived,
                total_s=now - stream.arrived,
            )
        )
        stream.done = True
        metrics.E2E_LATENCY.labels(self.worker).observe(now - stream.arrived)
        metrics.REQUESTS_FINISHED.labels(self.worker, reason.kind.value).inc()
        self.streams.pop(stream.rid, None)
        rids = self._groups.get(stream.call)
        if rids is not None and all(r not in self.streams for r in rids):
            del self._groups[stream.call]

    def _abort_all(self, message: str) -> None:
        for stream in list(self.streams.values()):
            if not stream.done:
                self._finish_stream(stream, FinishReason.abort(message))

    # --- timeouts, books, invariants, logs ------------------------------------------------------------

    def _check_books(self, step_id: int, expected: tuple[int, int], result: StepResult) -> None:
        reported = (result.kv.live_seqs, result.kv.seq_slots)
        self.reported_kv = reported
        if reported != expected or result.kv.capacity_tokens != self.limits.kv_capacity_tokens:
            self.kv_mismatches += 1
            metrics.KV_BOOK_MISMATCHES.labels(self.worker).inc()
            self.log.error(
                "kv books mismatch",
                step=step_id,
                book_live_seqs=expected[0],
                book_seq_slots=expected[1],
                worker_live_seqs=reported[0],
                worker_seq_slots=reported[1],
                worker_capacity=result.kv.capacity_tokens,
            )

    async def _check_pool_while_idle(self) -> None:
        """The pool invariants, in slices of about a millisecond with the loop free between them.

        Only the engine's own loop changes the scheduler, and it is here; arrivals and aborts wait
        in the inbox. So the state holds still across slices, and the check is dropped (to start
        afresh at the next idle time) as soon as work arrives.
        """
        if not self._pool_dirty:
            return
        sched = self.scheduler
        check = PoolCheck(sched.kv.allocator, sched.kv.tree, sched.private_slots())
        while not self._inbox and not self._stopping:
            try:
                done = check.run(IDLE_CHECK_BUDGET)
            except InvariantError as exc:
                self.log.error("kv pool invariant violated", error=str(exc))
                done = True
            if done:
                self._pool_dirty = False
                return
            await asyncio.sleep(0)

    def _check_invariants(self) -> None:
        sched = self.scheduler
        try:
            check_pool_invariants(sched.kv.allocator, sched.kv.tree, sched.private_slots())
        except AssertionError as exc:
            self.log.error("kv pool invariant violated", error=str(exc))
            if self.config.scheduler.strict_invariants:
                raise


def _sample_params(params: RequestParams, index: int, n: int, group: str) -> RequestParams:
    """Sample i of n: seed + i, and a group name so the samples are retracted together or not at all."""
    if n == 1:
        return params
    seed = params.sampler.seed
    # Seeds are uint64 on the wire: sample i's seed wraps around rather than overflowing.
    wrapped = None if seed is None else (seed + index) % SEED_SPACE
    sampler = params.sampler if wrapped is None else dataclasses.replace(params.sampler, seed=wrapped)
    return dataclasses.replace(params, sampler=sampler, group=group)
