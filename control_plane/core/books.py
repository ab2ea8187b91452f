"""One worker's books: what the worker reports holding after each step against what the core's
books say it holds, and the KV pool's invariants (after every step under --strict-invariants,
else in slices while the worker idles)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from control_plane import metrics
from control_plane.cache.invariants import InvariantError, PoolCheck, check_pool_invariants
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import StepResult

# Work units of the idle pool check per slice (about a millisecond), between which the loop yields.
IDLE_CHECK_BUDGET = 4096


class Books:
    def __init__(
        self, worker: str, capacity: int, strict: bool, log: structlog.typing.FilteringBoundLogger
    ) -> None:
        self.worker = worker
        self.capacity = capacity
        self.strict = strict
        self.log = log
        # Books vs. the worker's report (GetServerInfo shows both, and the mismatches).
        self.kv_mismatches = 0
        self.reported_kv = (0, 0)
        # The pool has changed since its last complete idle check.
        self.pool_dirty = True

    def check(self, step_id: int, expected: tuple[int, int], result: StepResult) -> None:
        """The worker's report after a step against the books (live sequences, slots in their tables)."""
        self.pool_dirty = True
        reported = (result.kv.live_seqs, result.kv.seq_slots)
        self.reported_kv = reported
        if reported != expected or result.kv.capacity_tokens != self.capacity:
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

    def check_pool(self, sched: Scheduler) -> None:
        """The pool invariants at once (after every step under --strict-invariants: a broken pool
        then ends the run loudly)."""
        try:
            check_pool_invariants(sched.kv.allocator, sched.kv.tree, sched.private_slots())
        except AssertionError as exc:
            self.log.error("kv pool invariant violated", error=str(exc))
            if self.strict:
                raise

    async def check_pool_while_idle(self, sched: Scheduler, interrupted: Callable[[], bool]) -> None:
        """The pool invariants, in slices of about a millisecond with the loop free between them.

        Only the engine's own loop changes the scheduler, and it is here; arrivals and aborts wait
        in the inbox. So the state holds still across slices, and the check is dropped (to start
        afresh at the next idle time) as soon as work arrives (`interrupted`).
        """
        if not self.pool_dirty:
            return
        check = PoolCheck(sched.kv.allocator, sched.kv.tree, sched.private_slots())
        while not interrupted():
            try:
                done = check.run(IDLE_CHECK_BUDGET)
            except InvariantError as exc:
                self.log.error("kv pool invariant violated", error=str(exc))
                done = True
            if done:
                self.pool_dirty = False
                return
            await asyncio.sleep(0)
