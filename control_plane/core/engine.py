"""One step loop per worker: plan, send, receive, apply, publish.

The engine owns a Scheduler (pure) and a WorkerChannel (the wire). With overlap (the default,
docs/scheduler.md#overlap) two plans are in flight (pipeline.py): the plan for step N+1 is on its
way while the worker runs step N, so the worker starts N+1 the moment N ends. Every turn sends the
next plan before it publishes the previous step's tokens, so publishing never delays the accelerator.

Arrivals, aborts and stop-string finishes wait in an inbox (inbox.py) applied at the top of each
turn (admission.py), so the scheduler sees them at a well-defined step (what the recorder stamps).
The engine's collaborators each own their state and are handed what they need: Streams
(publisher.py: the live samples and what the frontends hear of them, through the hub's Publisher),
HandOver (handover.py: a lost worker's requests continue on another engine; a fault of our own
restarts the scheduler), Drain (drain.py: a worker that drains or is asked to move), Migrations
(migration.py: running requests that move to another worker with their KV, or come here so),
Timeouts (timeouts.py), StepLog (step_log.py: log lines and metrics), Books (books.py: the worker's
report against the books, the pool's invariants); worker_checks.py checks every result. What spans
workers (who inherits, which calls move where) the Fleet decides (core/fleet/), and the Mover
(mover.py) starts the moves it decides and settles the word of their copies.

Every request ends with its tokens or an explicit finish reason, whichever way `run` ends. A lost
worker (WorkerGone: its stream broke or it failed a step; WorkerFault: it broke the protocol or
hung; CancelledError: gRPC cancelled its handler) first has its inbox applied, so arrivals not yet
seen become requests too, then every live request continues on another engine from its last
streamed token, or ends with an abort naming the error if there is none. A fault of our own does
not end the loop: each request continues on a fresh scheduler, or ends with an abort once it has
lived through MAX_FAULTS_PER_REQUEST. A drain or move ends the loop only once nothing is live
(queued requests moved at once, running ones migrated with their KV, or else finished here or
handed over past --drain-timeout), and `stop` (the control plane stopping) ends each live request
with an abort. On every exit the engine closes before its first await: the router passes it by
from then on, so nothing arrives while the session's last message goes out, and whatever is still
here, inbox included, ends with an abort; a call always hears its verdict before its finish. An
engine whose welcome failed is closed the same way (`abandon`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from typing import Protocol

import structlog

from control_plane import metrics
from control_plane.cache.invariants import InvariantError
from control_plane.config import ControlConfig
from control_plane.core.admission import admit, admit_orphan
from control_plane.core.books import Books
from control_plane.core.drain import Departure, Drain, Leaving
from control_plane.core.fleet import BALANCE_REASONS, Call, Fleet, Move, Room
from control_plane.core.grammar_gate import GrammarGate
from control_plane.core.handover import HandOver, WorkerGone
from control_plane.core.inbox import (
    AbortItem,
    Arrival,
    Forget,
    Immigrant,
    Inbox,
    Orphan,
    Precopied,
    StopItem,
    Verdict,
)
from control_plane.core.migration import Destination, Migrations
from control_plane.core.mover import Mover
from control_plane.core.pipeline import Pipeline
from control_plane.core.publisher import Publisher, Streams
from control_plane.core.step_log import StepLog
from control_plane.core.timeouts import Timeouts
from control_plane.core.worker_checks import WorkerFault, check_result
from control_plane.link import link_of
from control_plane.record.recorder import close_recording, make_scheduler
from control_plane.request import AbortCode, FinishReason
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import Grammar, StepPlan, StepResult, TransferOutcome, WorkerLimits

log = structlog.get_logger("stepwise.engine")

SHUTTING_DOWN = "control plane is shutting down"


class WorkerChannel(Protocol):
    async def send(self, plan: StepPlan) -> None: ...

    async def receive(self) -> StepResult: ...

    async def close(self, reason: str) -> None: ...

    async def move(self, reason: str) -> None: ...

    async def drop(self, reason: str) -> None: ...


class Engine:
    """Drives one worker. All scheduler calls happen inside `run` (and `submit`'s registration),
    one at a time, on the core's event loop.

    `fleet` (core/fleet/) is what this engine knows of the other workers: who takes over its
    requests when its worker is lost or leaves, which of its running calls move after a step and
    where, the engine a transfer its worker received came from; it is told when this engine
    starts leaving and when its loop ends. Without one the worker is alone."""

    def __init__(
        self,
        config: ControlConfig,
        limits: WorkerLimits,
        channel: WorkerChannel,
        publisher: Publisher,
        fleet: Fleet[Engine] | None = None,
    ) -> None:
        self.config = config
        self.limits: WorkerLimits = limits
        self.channel = channel
        # The worker's grammar gate (set by the server): orphans wait there for their grammar.
        self.grammar_gate: GrammarGate | None = None
        self.worker: str = limits.worker_id
        metrics.register_worker(self.worker)
        self.log = log.bind(worker=limits.worker_id)
        self.step_log = StepLog(self.worker, config.decode_log_interval, self.log)
        self.fleet: Fleet[Engine] = fleet if fleet is not None else Fleet()
        self.streams = Streams(publisher, self.worker, self.step_log.metrics)
        self.handover = HandOver(self.streams, self.worker, self.log, self._heir)
        self.drain = Drain(config.drain_timeout_s, self.streams, self.handover, self.worker, self.log)
        self.migration = Migrations(
            self.worker, limits, self.streams, self.log, self._fallback, self.fleet.moved
        )
        self.timeouts = Timeouts(config.waiting_timeout_s, config.running_timeout_s, self.streams.admitted_at)
        # A RecordingScheduler under --record DIR: every call below is also written down.
        self.scheduler: Scheduler = make_scheduler(config, limits)
        self.pipeline = Pipeline(channel, 2 if config.overlap else 1, config.limits.step_deadline_s)
        self.inbox = Inbox()
        self.mover = Mover(config, self.fleet, self.migration, self.streams, self.inbox.wake)
        self._stopping = False
        # The loop has ended (or will never run): nothing may wait here any more.
        self._closed = False
        # When the worker attached (the newest is the one asked to move).
        self.attached_at: float = time.monotonic()
        # The session ended because the worker left (drained or moved), not because it was lost.
        self.departed = False
        # Why the worker was dropped for breaking the protocol (or hanging); None while it behaves.
        self.fault: str | None = None
        self.books = Books(
            self.worker, limits.kv_capacity_tokens, config.scheduler.strict_invariants, self.log
        )
        self.steps: int = 0

    @property
    def leaving(self) -> Leaving | None:
        """The drain or move under way (None: the worker stays)."""
        return self.drain.leaving

    @property
    def serving(self) -> bool:
        """New requests may come here: the loop has not ended and the worker is not leaving."""
        return not self._closed and self.drain.leaving is None

    def _heir(self) -> Engine | None:
        return self.fleet.heir(self)

    def _fallback(self) -> Destination | None:
        """Where a request whose migration failed continues: here while this engine serves (its
        prefix is cached here), else on an heir."""
        return self if self.serving else self._heir()

    # --- called by the hub ---------------------------------------------------------------------------

    def submit(self, arrival: Arrival) -> None:
        """Queue a Generate call's samples; the publisher gets the verdict once the scheduler has seen
        it (accepted, or refused with the reason)."""
        if self._closed:  # the router passes a closed engine by: this is a caller's slip, answered
            self.streams.refuse(arrival.samples, Verdict.UNAVAILABLE, f"worker {self.worker} is gone")
            return
        self.streams.arrive(arrival.samples)
        self.inbox.put(arrival)

    def abort(self, rid: str, message: str, code: AbortCode = AbortCode.CANCELLED) -> bool:
        """Abort a Generate call (all its samples) or one sample by its own id."""
        live = self.streams.rids_of(rid)
        self.inbox.put(*(AbortItem(r, FinishReason.abort(message, code)) for r in live))
        moving = self.migration.end_in_transit(
            lambda s: rid in (s.rid, s.call), FinishReason.abort(message, code)
        )
        return bool(live) or bool(moving)

    def stop_sample(self, uid: int, reason: FinishReason) -> bool:
        """A frontend ended this sample on a stop string (one step late: tokens since are dropped)."""
        rid = self.streams.rid_of_uid(uid)
        if rid is None:
            return bool(self.migration.end_in_transit(lambda s: s.uid == uid, reason))
        self.inbox.put(StopItem(rid, reason))
        return True

    def abort_everything(self, message: str) -> int:
        """Abort every live sample (the control plane drained past its timeout). Returns how many."""
        rids = self.streams.rids()
        self.inbox.put(*(AbortItem(rid, FinishReason.abort(message)) for rid in rids))
        return len(rids) + self.migration.end_in_transit(lambda _s: True, FinishReason.abort(message))

    def abort_link(self, link_id: int, message: str) -> int:
        """A frontend died: abort every sample it submitted. Returns how many."""
        rids = self.streams.rids_of_link(link_id)
        reason = FinishReason.abort(message, AbortCode.CANCELLED)
        self.inbox.put(*(AbortItem(rid, reason) for rid in rids))
        return len(rids) + self.migration.end_in_transit(lambda s: link_of(s.uid) == link_id, reason)

    def adopt(self, orphans: list[Orphan]) -> None:
        """Take over requests of a lost or leaving worker: their streams continue here."""
        if self._closed:  # as in submit: never chosen as an heir once closed
            for orphan in orphans:
                message = f"its worker went away and {self.worker}, which was to take it over, is gone too"
                self.streams.finish(orphan.sample, FinishReason.abort(message))
            return
        for orphan in orphans:
            self.streams.adopt(orphan.sample)
            self._admit_compiled(orphan)

    def _admit_compiled(self, orphan: Orphan) -> None:
        """To the inbox once the worker holds the orphan's grammar compiled, so that its first
        plan makes no step compile (docs/protocols.md#grammars-compiled-before-they-are-planned)."""
        grammar = orphan.params.sampler.grammar
        if grammar is None or self.grammar_gate is None:
            self.inbox.put(orphan)
            return

        def proceed() -> None:
            if not self._closed and self.streams.knows(orphan.sample.rid):  # not aborted meanwhile
                self.inbox.put(orphan)

        self.grammar_gate.after(grammar, proceed)

    def precopied(self, transfer_id: str, tokens: tuple[int, ...]) -> bool:
        """A running request's KV was pre-copied to this worker: it is held here until the request
        comes. False when this engine takes no requests."""
        if not self.serving:
            return False
        self.inbox.put(Precopied(transfer_id, tokens))
        return True

    def immigrate(self, item: Immigrant) -> bool:
        """A request migrated here: its KV is in this worker's transfer store (and held prefix).
        False when this engine takes no requests (the source then keeps it)."""
        if not self.serving:
            return False
        self.streams.adopt(item.orphan.sample)
        self.inbox.put(item)
        return True

    def forget_transfer(self, transfer_id: str) -> None:
        """A migration to here was given up: the worker drops its copy (now or when it arrives)."""
        if not self._closed:
            self.inbox.put(Forget(transfer_id))

    def worker_received(self, outcome: TransferOutcome) -> None:
        """This worker holds a transfer in full (its own report, which its channel passes on as it
        comes): the word goes to the engine whose worker sent it (mover.py)."""
        self.mover.worker_received(outcome, self.worker)

    def knows(self, rid: str) -> bool:
        """A live call or sample here, or one migrating from here whose tail is on its way."""
        return self.streams.knows(rid) or bool(self.migration.in_transit(lambda s: rid in (s.rid, s.call)))

    def owner_of(self, rid: str) -> str | None:
        """Who submitted the live Generate call (or sample) `rid`; None when it is not live here."""
        owner = self.streams.owner_of(rid)
        if owner is None:
            moving = self.migration.in_transit(lambda s: rid in (s.rid, s.call))
            owner = moving[0].owner if moving else None
        return owner

    def load(self) -> tuple[int, int]:
        """(queued, running) for routing and server info."""
        sched = self.scheduler
        return len(sched.waiting) + self.inbox.arriving(), len(sched.running)

    def leave(self, departure: Departure, reason: str) -> None:
        """Start leaving: at once for the router, on the loop's next turn for the requests (drain.py)."""
        if self.drain.start(departure, reason):
            self.fleet.leaving(self)
            self.inbox.wake.set()

    def worker_draining(self, reason: str) -> None:
        """The worker sent Drain (its channel calls this)."""
        self.leave(Departure.SHUTDOWN, reason or "the worker is stopping")

    def stop(self) -> None:
        self._stopping = True
        self.inbox.wake.set()

    # --- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Step until stopped or the worker is gone; every live request ends with a finish reason.

        Faults are contained: a worker that breaks the protocol or hangs is dropped (`fault` says
        why) and its requests continue elsewhere; an exception of our own restarts this worker's
        scheduler (`_recover`) and the loop goes on serving.
        """
        dropped = ""  # why the worker is let go while it may still be listening
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
            self.fault = dropped = str(exc)
            self.log.error("worker dropped", error=self.fault)
            self._hand_over(self.fault)
        except WorkerGone as exc:
            dropped = str(exc)  # moot when the stream broke; not when our own loop gave up on it
            self._hand_over(dropped)
        except asyncio.CancelledError:
            # gRPC cancels the Connect handler when the worker's connection drops: that is a lost
            # worker too, unless the control plane itself is stopping.
            if not self._stopping:
                self._hand_over("the worker's stream was cancelled")
            raise
        finally:
            self._close()  # before the await: nothing comes in while the last message goes out
            with contextlib.suppress(Exception):
                await self._end_session(dropped)

    async def _end_session(self, dropped: str) -> None:
        """The session's last word, unless a drain or move has said it already: Shutdown only
        when this control plane stops; a worker we let go for any other reason is told why
        (Dropped), and searches again instead of exiting for good."""
        if dropped and not self._stopping:
            await self.channel.drop(f"dropped by the control plane: {dropped}")
        else:
            await self.channel.close(SHUTTING_DOWN)

    def abandon(self, error: str) -> None:
        """The session ended before the loop ran (the welcome could not be sent): what the router
        gave this engine meanwhile continues on another one, or ends with an abort."""
        try:
            self._hand_over(error)
        finally:
            self._close()

    def _close(self) -> None:
        """No more requests come here (the router passes a closed engine by, and `submit` and `adopt`
        answer at once), and every one still here ends with an abort: those in the inbox too, their
        calls let through to read it."""
        self._closed = True
        self.fleet.gone(self)
        self.inbox.take()
        self.migration.abort_all(SHUTTING_DOWN)
        self.streams.abort_all(SHUTTING_DOWN)
        close_recording(self.scheduler)

    async def _iteration(self) -> None:
        self._drain_inbox()
        if self.migration.busy:
            self.mover.fail_overdue_copies()
        self.migration.switch_ready(self.scheduler)
        if self._leave_turn():
            await self._depart()
            return
        if self.timeouts.enabled:
            self.timeouts.check(self.scheduler, time.monotonic())
        await self._fill_pipeline()
        self._publish()  # after the next plan went out: publishing never delays the worker
        if self.pipeline:
            await self._receive()
        else:
            await self._idle()

    async def _fill_pipeline(self) -> None:
        """Plan and send until the pipeline is full or there is nothing to do."""
        while not self.pipeline.full:
            plan = self.scheduler.next_plan()
            if self.scheduler.emigrants:
                self.mover.emigrate(self.scheduler)  # before the publish: their finish here is no finish
            if self.timeouts.enabled:
                self.timeouts.note_waiting(self.scheduler, time.monotonic())
            if plan is None:
                if not self.migration.wants_plan(idle=not self.pipeline):
                    return
                plan = self.scheduler.next_plan(always=True)  # to ask the worker about a copy
                assert plan is not None
            stats = self.scheduler.last_stats
            assert stats is not None
            self.streams.note_admissions(plan, self.scheduler.requests)
            await self.pipeline.send(plan, stats, self.scheduler.books())

    def _publish(self) -> None:
        self.streams.publish(self.scheduler.take_updates())

    async def _receive(self) -> None:
        flight, result = await self.pipeline.receive()
        plan = flight.plan
        if result.error:
            raise WorkerGone(f"worker failed step {plan.step_id}: {result.error}")
        if result.transfers:  # a stale result's too: the copies went on
            self.migration.outcomes(result.transfers)
            self.migration.switch_ready(self.scheduler)
        if flight.stale:
            return
        check_result(plan, result, self.limits.vocab_size)
        self.handover.step_completed()
        self.books.check(plan.step_id, flight.books, result)
        self.scheduler.apply_result(result)
        self.migration.note_tokens(self.scheduler)
        self.steps += 1
        self.step_log.timed(result.wait_s, result.forward_s)
        if self.config.scheduler.strict_invariants:
            self.books.check_pool(self.scheduler)
        self.step_log.record(plan, flight.stats, self.scheduler)
        self.mover.place(self)  # the fleet decides which calls move, the mover starts them

    async def _idle(self) -> None:
        if self.scheduler.is_idle:
            self.scheduler.on_idle()
            await self.books.check_pool_while_idle(self.scheduler, lambda: bool(self.inbox) or self._stopping)
        self.inbox.wake.clear()
        if self.inbox or self._stopping or (self.leaving is not None and not self.leaving.begun):
            return
        timeout = self.timeouts.poll_s() if self.streams else None
        for wait_s in (self.drain.wait_s(), self.migration.wait_s()):
            if wait_s is not None:
                timeout = wait_s if timeout is None else min(timeout, wait_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.inbox.wake.wait(), timeout)

    # --- what the fleet reads and tells (fleet/member.py); the mover moves (mover.py) ---------------

    def start_move(self, move: Move) -> bool:
        """Start migrating a call (migration.py); False when it cannot start."""
        return self.mover.start(self.scheduler, move)

    def holds_compiled(self, grammars: list[Grammar]) -> bool:
        """Whether this worker holds every one of `grammars` compiled; it is asked to compile the
        others (grammar_gate.py), so a move that waits for them finds them at a later decision."""
        gate = self.grammar_gate
        return gate is None or all([gate.compiled(grammar) for grammar in grammars])

    def room(self, steps: int) -> Room:
        """This worker's KV once its running requests have decoded `steps` more (fleet/balance.py)."""
        sched = self.scheduler  # waiting: what the latest plan did not admit
        return Room(sched.decode_headroom(steps), sched.capacity, len(sched.waiting))

    def calls(self, steps: int, by_retraction: bool) -> Iterator[Call]:
        return self.mover.calls(self.scheduler, steps, by_retraction)

    def balancing(self) -> bool:
        return self.migration.underway(BALANCE_REASONS)

    def heading(self) -> Counter[str]:
        return self.migration.heading()

    def destination_gone(self, worker: str, why: str) -> None:
        self.mover.destination_gone(worker, why)

    # --- leaving, losing the worker, faults of our own -------------------------------------------

    def _leave_turn(self) -> bool:
        """A turn of leaving (a drain or move), if one is under way: True once nothing is live here
        and no plan is in flight, so the session can end."""
        leaving = self.drain.leaving
        if leaving is None:
            return False
        if not leaving.begun:
            self.drain.begin(self.scheduler, self.load())
        if self.config.drain_migration and self.streams:
            leaving.migrated += self.mover.drain(self)
        self.drain.check_deadline(self.scheduler)
        return not self.streams and not self.pipeline and not self.migration.busy

    async def _depart(self) -> None:
        self.departed = True
        await self.drain.depart(self.channel)

    def _hand_over(self, error: str) -> None:
        """The worker is lost: every live request continues on another engine (or ends)."""
        self._drain_inbox()  # arrivals not yet seen become requests too; aborts take effect
        self.migration.lost(self._heir(), error)
        self.handover.worker_lost(self.scheduler, error)

    def _recover(self, exc: Exception) -> None:
        """Log the fault, replace the scheduler, and continue every live request on the fresh one;
        the worker is told to forget everything with the next plan (handover.py says what is kept)."""
        self.log.error("step loop fault: restarting this worker's scheduler", exc_info=exc)
        orphans = self.handover.salvage(self.scheduler, exc, self.inbox.waiting_rids())
        with contextlib.suppress(Exception):
            close_recording(self.scheduler)
        self.scheduler = make_scheduler(self.config, self.limits)
        self.mover.recovered()
        self.pipeline.forget()
        self.pipeline.reset_worker()
        self.migration.recovered()
        self.books.pool_dirty = True
        self.inbox.items.extend(orphans)

    # --- the inbox -----------------------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        for item in self.inbox.take():
            if isinstance(item, Arrival):
                admit(self.scheduler, self.streams, item, self.log)
            elif isinstance(item, Orphan):
                admit_orphan(self.scheduler, self.streams, item, self.worker)
            elif isinstance(item, Immigrant):
                self.migration.arrive(self.scheduler, item)
                admit_orphan(self.scheduler, self.streams, item.orphan, self.worker)
            elif isinstance(item, Forget | Precopied):
                self.migration.arrive(self.scheduler, item)
            elif isinstance(item, StopItem):
                self._stop(item)
            elif not self.scheduler.abort(item.rid, item.reason):
                self.streams.fail(item.rid, item.reason)

    def _stop(self, item: StopItem) -> None:
        """A stop string: finish and cache a running request; a queued one (retracted meanwhile) is
        aborted with the same reason. Its frontend has ended the stream already."""
        if not self.scheduler.finish(item.rid, item.reason):
            self.scheduler.abort(item.rid, item.reason)
