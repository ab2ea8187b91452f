"""SGLang's continuous-batching scheduler for one worker (SCHEDULER.md §1–§6).

A plain, synchronous, deterministic object: arrivals, aborts and worker results go in, step plans
come out. No wall clock, no unseeded randomness, no I/O. The engine drives it:

    plan = scheduler.next_plan()        # §1.3 get_next_batch_to_run
    result = <the worker runs plan>
    scheduler.apply_result(result)      # §4.3 / process_batch_result
    updates = scheduler.take_updates()  # tokens and finishes to publish
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from control_plane.request import Request
from control_plane.scheduler.intake import PRIORITY_EVICTED, QUEUE_FULL
from control_plane.scheduler.plan import StepKind, StepPlan
from control_plane.scheduler.results import Results
from control_plane.scheduler.retraction import HOST_POOL_FULL, OOM_LAST_REQUEST
from control_plane.scheduler.sizing import clamp_max_new_tokens, resolve_max_running_requests
from control_plane.scheduler.state import MAX_INT, QueueFull, RequestRejected, RequestUpdate, StepStats

__all__ = [
    "HOST_POOL_FULL",
    "MAX_INT",
    "OOM_LAST_REQUEST",
    "PRIORITY_EVICTED",
    "QUEUE_FULL",
    "QueueFull",
    "RequestRejected",
    "RequestUpdate",
    "Scheduler",
    "StepStats",
    "clamp_max_new_tokens",
    "resolve_max_running_requests",
]


class Scheduler(Results):
    """SGLang's scheduler for one worker's pool. Every public method is deterministic given the call
    sequence. Each rule lives in the module of its seam (see control_plane/scheduler/state.py)."""

    def next_plan(self) -> StepPlan | None:
        """Decide the next step. Returns None when there is nothing to do (not even a release)."""
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
        return self._build_plan(batch, stats)

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not len(self.running) and self.chunked_req is None and not self.requests

    def on_idle(self) -> None:
        """Fully idle: reset the new-token ratio (§1.4)."""
        self.ratio.reset()

    def live_handles(self) -> int:
        return len(self.by_handle)

    def live_seq_slots(self) -> int:
        """Σ committed KV positions over live sequences: what the worker's slot tables must hold."""
        return sum(r.kv_committed_len for r in self.by_handle.values())

    def private_slots(self) -> int:
        """Slots held by live requests and not owned by the tree (whole pages)."""
        page = self.page_size
        return sum(
            math.ceil(r.kv_committed_len / page) * page - r.cache_protected_len
            for r in self.by_handle.values()
        )

    def pending_tokens(self) -> int:
        waiting = sum(r.seqlen for r in self.waiting)
        chunked = self.chunked_req
        return waiting + (chunked.seqlen - chunked.extend_range[1] if chunked is not None else 0)

    def live_requests(self) -> Iterable[Request]:
        return self.requests.values()
