"""One step loop per worker: plan, send, receive, apply, publish.

The engine owns a Scheduler (pure) and a WorkerChannel (the wire). With overlap (the default,
docs/scheduler.md#overlap) two plans are in flight: the plan for step N+1 is on its way while the worker runs
step N, so the worker starts N+1 the moment N ends. Every turn sends the next plan before it
publishes the previous step's tokens, so publishing never delays the accelerator.

Arrivals, aborts and stop-string finishes wait in an inbox applied at the top of each turn, so the
scheduler sees them at a well-defined step (what the recorder stamps). The rest lives beside it:
publishing.py (to the frontends through a Publisher), failover.py (lost workers, faults of our own),
drain.py (a worker that drains or is asked to move), timeouts.py, step_log.py (log lines and
metrics), worker_checks.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from control_plane import metrics
from control_plane.cache.invariants import InvariantError, PoolCheck, check_pool_invariants
from control_plane.config import ControlConfig
from control_plane.core.drain import Draining, Leaving
from control_plane.core.failover import WorkerGone
from control_plane.core.inbox import AbortItem, Arrival, Item, LiveSample, Orphan, StopItem, Verdict
from control_plane.core.publishing import Publisher
from control_plane.core.step_log import StepLog
from control_plane.core.timeouts import Timeouts
from control_plane.core.worker_checks import WorkerFault, check_result
from control_plane.link import link_of
from control_plane.record.recorder import close_recording, make_scheduler
from control_plane.request import AbortCode, FinishReason, RequestParams
from control_plane.scheduler.plan import StepPlan, StepResult, WorkerLimits
from control_plane.scheduler.records import StepStats
from control_plane.scheduler.scheduler import QueueFull, RequestRejected

log = structlog.get_logger("stepwise.engine")

# Work units of the idle pool check per slice (about a millisecond), between which the loop yields.
IDLE_CHECK_BUDGET = 4096
SEED_SPACE = 1 << 64


class WorkerChannel(Protocol):
    async def send(self, plan: StepPlan) -> None: ...

    async def receive(self) -> StepResult: ...

    async def close(self, reason: str) -> None: ...

    async def move(self, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class InFlight:
    """A plan sent and not yet answered, with what its result will be checked against."""

    plan: StepPlan
    stats: StepStats
    # (live sequences, slots in their tables) the worker must report after this plan.
    books: tuple[int, int]
    # Planned by a scheduler since replaced (after a fault of ours): its result is read and dropped.
    stale: bool = False


class Engine(Draining):
    """Drives one worker. All scheduler calls happen inside `run` (and `submit`'s registration),
    one at a time, on the core's event loop."""

    def __init__(
        self, config: ControlConfig, limits: WorkerLimits, channel: WorkerChannel, publisher: Publisher
    ) -> None:
        self.config = config
        self.limits = limits
        self.channel = channel
        self.publisher = publisher
        # A RecordingScheduler under --record DIR: every call below is also written down.
        self.scheduler = make_scheduler(config, limits)
        self.depth = 2 if config.overlap else 1
        self._inflight: deque[InFlight] = deque()
        # Live samples by request id (rid, or rid/i of an n > 1 call), and calls by their id.
        self.samples: dict[str, LiveSample] = {}
        self._groups: dict[str, list[str]] = {}
        self._inbox: list[Item] = []
        # Called when the worker is lost: returns the engine that takes over its requests, if any.
        self.successor: Callable[[Engine], Engine | None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        # When the worker attached (the newest is the one asked to move), and its drain or move.
        self.attached_at = time.monotonic()
        self.leaving: Leaving | None = None
        self.on_leaving: Callable[[Engine], None] | None = None
        # The session ended because the worker left (drained or moved), not because it was lost.
        self.departed = False
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
        # The worker's idle gap before each of its recent steps (GetServerInfo shows percentiles).
        self.waits: deque[float] = deque(maxlen=1000)
        self.wait_total_s = 0.0
        self.step_total_s = 0.0
        self.step_log = StepLog(self.worker, config.decode_log_interval, self.log)
        self.timeouts = Timeouts(config.waiting_timeout_s, config.running_timeout_s, self._first_forward)

    # --- called by the hub ---------------------------------------------------------------------------

    def submit(self, arrival: Arrival) -> None:
        """Queue a Generate call's samples; the publisher gets the verdict once the scheduler has seen
        it (accepted, or refused with the reason)."""
        for sample in arrival.samples:
            self.samples[sample.rid] = sample
        first = arrival.samples[0]
        self._groups[first.call] = [s.rid for s in arrival.samples]
        self._inbox.append(arrival)
        self._wake.set()

    def abort(self, rid: str, message: str, code: AbortCode = AbortCode.CANCELLED) -> bool:
        """Abort a Generate call (all its samples) or one sample by its own id."""
        rids = self._groups.get(rid, [rid] if rid in self.samples else [])
        live = [r for r in rids if r in self.samples]
        for r in live:
            self._inbox.append(AbortItem(r, FinishReason.abort(message, code)))
        self._wake.set()
        return bool(live)

    def stop_sample(self, uid: int, reason: FinishReason) -> bool:
        """A frontend ended this sample on a stop string (one step late: tokens since are dropped)."""
        rid = next((r for r, s in self.samples.items() if s.uid == uid), None)
        if rid is None:
            return False
        self._inbox.append(StopItem(rid, reason))
        self._wake.set()
        return True

    def abort_everything(self, message: str) -> int:
        """Abort every live sample (the control plane drained past its timeout). Returns how many."""
        rids = list(self.samples)
        for rid in rids:
            self._inbox.append(AbortItem(rid, FinishReason.abort(message)))
        self._wake.set()
        return len(rids)

    def abort_link(self, link_id: int, message: str) -> int:
        """A frontend died: abort every sample it submitted. Returns how many."""
        rids = [r for r, s in self.samples.items() if link_of(s.uid) == link_id]
        for rid in rids:
            self._inbox.append(AbortItem(rid, FinishReason.abort(message, AbortCode.CANCELLED)))
        self._wake.set()
        return len(rids)

    def knows(self, rid: str) -> bool:
        return rid in self._groups or rid in self.samples

    def owner_of(self, rid: str) -> str | None:
        """Who submitted the live Generate call (or sample) `rid`; None when it is not live here."""
        rids = self._groups.get(rid, [rid])
        sample = next((self.samples[r] for r in rids if r in self.samples), None)
        return sample.owner if sample is not None else None

    def load(self) -> tuple[int, int]:
        """(queued, running) for routing and server info."""
        sched = self.scheduler
        arriving = sum(len(m.samples) for m in self._inbox if isinstance(m, Arrival))
        return len(sched.waiting) + arriving, len(sched.running)

    def _first_forward(self, rid: str) -> float | None:
        sample = self.samples.get(rid)
        return sample.admitted if sample is not None else None

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
            while not self._stopping and not self.departed:
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
        if self.leaving is not None and self._leave_turn():
            await self._depart()
            return
        if self.timeouts.enabled:
            self.timeouts.check(self.scheduler, time.monotonic())
        await self._fill_pipeline()
        self._publish()  # after the next plan went out: publishing never delays the worker
        if self._inflight:
            await self._receive()
        else:
            await self._idle()

    async def _fill_pipeline(self) -> None:
        """Plan and send until `depth` plans are in flight or there is nothing to do."""
        while len(self._inflight) < self.depth:
            plan = self.scheduler.next_plan()
            if self.timeouts.enabled:
                self.timeouts.note_waiting(self.scheduler, time.monotonic())
            if plan is None:
                return
            stats = self.scheduler.last_stats
            assert stats is not None
            self._note_admissions(plan)
            if self._reset_worker:
                plan, self._reset_worker = dataclasses.replace(plan, reset=True), False
            self._inflight.append(InFlight(plan, stats, self.scheduler.books()))
            await self.channel.send(plan)

    async def _receive(self) -> None:
        flight = self._inflight[0]
        result = await self._await_result()
        self._inflight.popleft()
        plan = flight.plan
        if result.error:
            raise WorkerGone(f"worker failed step {plan.step_id}: {result.error}")
        if flight.stale:
            return
        check_result(plan, result, self.limits.vocab_size)
        self._faults_in_a_row, self._pool_dirty = 0, True
        self._check_books(plan.step_id, flight.books, result)
        self.scheduler.apply_result(result)
        self.steps += 1
        self.waits.append(result.wait_s)
        self.wait_total_s += result.wait_s
        self.step_total_s += result.forward_s
        self.step_log.metrics.worker_wait.observe(result.wait_s)
        if self.config.scheduler.strict_invariants:
            self._check_invariants()
        self.step_log.record(plan, flight.stats, self.scheduler)

    async def _await_result(self) -> StepResult:
        """The oldest plan's result, no later than the in-flight plans' deadline (a hung worker)."""
        tokens = sum(len(f.plan.extends.token_ids) + len(f.plan.decodes) for f in self._inflight)
        deadline = self.config.limits.step_deadline_s(tokens)
        step = self._inflight[0].plan.step_id
        try:
            async with asyncio.timeout(deadline):  # no task per step, unlike wait_for
                return await self.channel.receive()
        except TimeoutError:
            raise WorkerFault(f"no result for step {step} within {deadline:.1f} s") from None

    def _forget_in_flight(self) -> None:
        self._inflight = deque(dataclasses.replace(f, stale=True) for f in self._inflight)

    async def _idle(self) -> None:
        if self.scheduler.is_idle:
            self.scheduler.on_idle()
            await self._check_pool_while_idle()
        self._wake.clear()
        if self._inbox or self._stopping or (self.leaving is not None and not self.leaving.begun):
            return
        timeout = self.timeouts.poll_s() if self.samples else None
        leave_s = self._leave_wait_s()
        if leave_s is not None:
            timeout = leave_s if timeout is None else min(timeout, leave_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    # --- the inbox -----------------------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, Arrival):
                self._admit(item)
            elif isinstance(item, Orphan):
                self._admit_orphan(item)
            elif isinstance(item, StopItem):
                self._stop(item)
            elif not self.scheduler.abort(item.rid, item.reason):
                self._fail_sample(item.rid, item.reason)

    def _admit(self, arrival: Arrival) -> None:
        """Add every sample of a call, or none: a refusal withdraws the samples already queued."""
        added: list[str] = []
        n = len(arrival.samples)
        try:
            for i, sample in enumerate(arrival.samples):
                params = _sample_params(arrival.params, i, n, sample.call)
                self.scheduler.add_request(sample.rid, arrival.input_ids, params, uid=sample.uid)
                added.append(sample.rid)
        except Exception as exc:
            verdict = _verdict(exc)
            if verdict is Verdict.INTERNAL:
                self.log.exception("admission failed", rid=arrival.samples[0].call)
            for rid in added:
                self.scheduler.abort(rid, FinishReason.abort(str(exc)))
            self._forget(arrival.samples)
            self.publisher.verdict(arrival.samples[0].uid, verdict, str(exc))
            return
        self.publisher.verdict(arrival.samples[0].uid, Verdict.ACCEPTED)

    def _stop(self, item: StopItem) -> None:
        """A stop string: finish and cache a running request; a queued one (retracted meanwhile) is
        aborted with the same reason. Its frontend has ended the stream already."""
        if not self.scheduler.finish(item.rid, item.reason):
            self.scheduler.abort(item.rid, item.reason)

    def _release_waiting_arrivals(self) -> None:
        """Arrivals the scheduler never saw: their calls are let through to read the abort."""
        inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, Arrival):
                self.publisher.verdict(item.samples[0].uid, Verdict.ACCEPTED)
            elif isinstance(item, Orphan):
                self.samples.setdefault(item.sample.rid, item.sample)

    # --- timeouts, books, invariants ------------------------------------------------------------------

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


def _verdict(exc: Exception) -> Verdict:
    if isinstance(exc, QueueFull):
        return Verdict.QUEUE_FULL
    if isinstance(exc, RequestRejected):
        return Verdict.REJECTED
    if isinstance(exc, ValueError):
        return Verdict.DUPLICATE
    return Verdict.INTERNAL


def _sample_params(params: RequestParams, index: int, n: int, group: str) -> RequestParams:
    """Sample i of n: seed + i, and a group name so the samples are retracted together or not at all."""
    if n == 1:
        return params
    seed = params.sampler.seed
    # Seeds are uint64 on the wire: sample i's seed wraps around rather than overflowing.
    wrapped = None if seed is None else (seed + index) % SEED_SPACE
    sampler = params.sampler if wrapped is None else dataclasses.replace(params.sampler, seed=wrapped)
    return dataclasses.replace(params, sampler=sampler, group=group)
