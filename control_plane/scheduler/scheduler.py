"""SGLang's continuous-batching scheduler for one worker
(docs/scheduler.md#step-loop–docs/scheduler.md#retraction).

A plain, synchronous, deterministic object: arrivals, aborts and worker results go in, step plans
come out. No wall clock, no unseeded randomness, no I/O. The engine drives it:

    plan = scheduler.next_plan()        # docs/scheduler.md#step-loop get_next_batch_to_run
    books = scheduler.books()           # what the worker must report after running `plan`
    result = <the worker runs plan>
    scheduler.apply_result(result)      # docs/scheduler.md#chunked-prefill / process_batch_result
    updates = scheduler.take_updates()  # tokens and finishes to publish

Overlap scheduling (docs/scheduler.md#overlap, SGLang's default): `next_plan` may be called again before the
previous plans' results are applied; results are then applied oldest first. Plans are executed in
order by the worker, so a slot freed here and reused by a later plan is always written after every
earlier plan's use of it. What this changes is SGLang's under overlap: a request whose prefill is in
flight is merged and decoded before its first token is known; a request that finishes when result N
is applied was already decoded in plan N+1 (its token is discarded); finishes, KV release and
streaming happen one step later. With each result applied before the next plan, the behaviour is
exactly the non-overlap one (`--disable-overlap-schedule`).
"""

from __future__ import annotations

import math

from control_plane.request import Request
from control_plane.scheduler.batch import ScheduledBatch
from control_plane.scheduler.intake import PRIORITY_EVICTED, QUEUE_FULL
from control_plane.scheduler.results import Results
from control_plane.scheduler.retraction import HOST_POOL_FULL, OOM_LAST_REQUEST
from control_plane.scheduler.sizing import clamp_max_new_tokens, resolve_max_running_requests
from control_plane.scheduler.state import (
    MAX_INT,
    QueueFull,
    RequestFinished,
    RequestRejected,
    StepStats,
    StepUpdates,
    TokenBatch,
)
from protos.worker import StepKind, StepPlan

__all__ = [
    "HOST_POOL_FULL",
    "MAX_INT",
    "OOM_LAST_REQUEST",
    "PRIORITY_EVICTED",
    "QUEUE_FULL",
    "QueueFull",
    "RequestFinished",
    "RequestRejected",
    "Scheduler",
    "StepStats",
    "StepUpdates",
    "TokenBatch",
    "clamp_max_new_tokens",
    "resolve_max_running_requests",
]


class Scheduler(Results):
    """SGLang's scheduler for one worker's pool. Every public method is deterministic given the call
    sequence. Each rule lives in the module of its seam (see control_plane/scheduler/state.py)."""

    def next_plan(self) -> StepPlan | None:
        """Decide the next step. Returns None when there is nothing to do (not even a release).

        Earlier plans may still be in flight; every plan returned must get its result applied, in
        plan order."""
        self._apply_pending_chunked_abort()
        if self.chunked_req is not None:
            self._stash_chunked_req(self.chunked_req)
        self._merge_last_batch()
        stats = StepStats(step_id=self.step_id + 1, kind=StepKind.PREFILL)
        batch = self._get_new_batch_prefill(stats)
        if batch is None and len(self.running):
            batch = self._update_running_batch(stats)
        self.last_batch = batch
        if batch is None and not (self._releases or self._remaps or self._offloads):
            return None
        self.step_id += 1
        if batch is not None:
            self.forward_ct += 1
        stats.queued = len(self.waiting)
        stats.new_token_ratio = self.ratio.current
        self.last_stats = stats
        plan = self._build_plan(batch, stats)
        in_flight = batch if batch is not None else ScheduledBatch(plan.kind)
        in_flight.step_id = plan.step_id
        self._in_flight.append(in_flight)
        return plan

    @property
    def in_flight(self) -> int:
        """Plans returned by next_plan whose results are not applied yet."""
        return len(self._in_flight)

    @property
    def is_idle(self) -> bool:
        return (
            not self.waiting
            and not len(self.running)
            and self.chunked_req is None
            and not self.requests
            and not self._in_flight
        )

    def on_idle(self) -> None:
        """Fully idle: reset the new-token ratio (docs/scheduler.md#idle)."""
        self.ratio.reset()

    def books(self) -> tuple[int, int]:
        """(live sequences, Σ slots in their slot tables) that the worker must report after running
        the most recently planned plan. Valid right after next_plan returned a plan; O(1)."""
        return len(self.by_handle), self._seq_slots

    def live_handles(self) -> int:
        return len(self.by_handle)

    def live_seq_slots(self) -> int:
        """Σ slots in the worker's tables of live sequences, after the most recent plan (books()[1])."""
        return self._seq_slots

    def private_slots(self) -> int:
        """Slots held by live requests and not owned by the tree (whole pages), decodes in flight
        included. O(live requests): for invariant checks."""
        page = self.page_size
        return sum(
            math.ceil(r.kv_allocated_len / page) * page - r.cache_protected_len
            for r in self.by_handle.values()
        )

    def pending_tokens(self) -> int:
        waiting = sum(r.seqlen for r in self.waiting)
        chunked = self.chunked_req
        return waiting + (chunked.seqlen - chunked.extend_range[1] if chunked is not None else 0)

    def live_requests(self) -> list[Request]:
        """Every request not yet finished, with its output_ids synced (failover continues each one
        from prompt + output_ids)."""
        self.kv.columns.sync_all()
        return list(self.requests.values())
