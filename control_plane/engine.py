"""One step loop per worker: plan, send, receive, apply, publish.

The engine owns a Scheduler (pure) and a WorkerChannel (the wire). Arrivals and aborts are queued
in an inbox and applied at the top of each iteration, so the scheduler sees them at a well-defined
step (what the recorder stamps). The rest of its work lives beside it, one concern a file:
streams.py (publishing to clients: detokenization, stop strings), failover.py (lost workers and
faults of our own), timeouts.py, step_log.py (log lines and metrics), worker_checks.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from control_plane import metrics
from control_plane.cache.invariants import InvariantError, PoolCheck, check_pool_invariants
from control_plane.config import ControlConfig
from control_plane.failover import Failover, WorkerGone
from control_plane.record.recorder import close_recording, make_scheduler
from control_plane.request import AbortCode, FinishReason, RequestParams
from control_plane.scheduler.plan import StepPlan, StepResult, WorkerLimits
from control_plane.scheduler.scheduler import QueueFull, RequestRejected
from control_plane.step_log import StepLog
from control_plane.streams import AbortItem, Arrival, Event, Orphan, RequestStream, Submission
from control_plane.timeouts import Timeouts
from control_plane.tokenizer import TextStream, Tokenizer
from control_plane.worker_checks import WorkerFault, check_result

log = structlog.get_logger("stepwise.engine")

# Work units of the idle pool check per slice (about a millisecond), between which the loop yields.
IDLE_CHECK_BUDGET = 4096
SEED_SPACE = 1 << 64


class WorkerChannel(Protocol):
    async def step(self, plan: StepPlan) -> StepResult: ...

    async def close(self, reason: str) -> None: ...


class Engine(Failover):
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
        self._inbox: list[Arrival | AbortItem | Orphan] = []
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
            Arrival(submission, streams, input_ids, [_sample_params(params, i, n, rid) for i in range(n)])
        )
        self._wake.set()
        return submission

    def abort(self, rid: str, message: str, code: AbortCode = AbortCode.CANCELLED) -> bool:
        """Abort a Generate call (all its samples) or one sample by its own id."""
        rids = self._groups.get(rid, [rid] if rid in self.streams else [])
        live = [r for r in rids if r in self.streams]
        for r in live:
            self._inbox.append(AbortItem(r, FinishReason.abort(message, code)))
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
        arriving = sum(len(m.streams) for m in self._inbox if isinstance(m, Arrival))
        return len(sched.waiting) + arriving, len(sched.running)

    def _wake_up(self) -> None:
        self._wake.set()

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
            if isinstance(item, Arrival):
                self._admit(item)
            elif isinstance(item, Orphan):
                self._admit_orphan(item)
            elif not self.scheduler.abort(item.rid, item.reason):
                self._fail_stream(item.rid, item.reason)

    def _admit(self, arrival: Arrival) -> None:
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
            if isinstance(item, Arrival) and not item.submission.accepted.done():
                item.submission.accepted.set_result(None)
            elif isinstance(item, Orphan):
                self.streams.setdefault(item.stream.rid, item.stream)

    # --- a lost worker's requests continue elsewhere (DESIGN.md, "The worker protocol") ----------------

    # --- a fault of our own: start this worker over (STYLE: faults are contained where they arise) ---

    # --- publishing -------------------------------------------------------------------------------

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
