"""Intake (docs/scheduler.md#intake): length checks, the max_new_tokens clamp, priorities at the door, and
the waiting queue with its cap (SGLang's waiting_queue and _add_request_to_queue)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from control_plane.config import SchedulerConfig
from control_plane.request import AbortCode, FinishReason, Request, RequestParams
from control_plane.scheduler.policy import Policy
from control_plane.scheduler.priority import urgency
from control_plane.scheduler.queue_clock import QueueClock
from control_plane.scheduler.records import MAX_INT, QueueFull, RequestRejected
from control_plane.scheduler.registry import Registry
from control_plane.scheduler.sizing import PoolSizes, clamp_max_new_tokens

QUEUE_FULL = "The request queue is full."
PRIORITY_EVICTED = "The request is aborted by a higher priority request."


class QueueWatcher(Protocol):
    """Told of every request that enters or leaves the waiting queue (the kept matches,
    queue_matches.py)."""

    def joined(self, req: Request) -> None: ...

    def left(self, req: Request) -> None: ...


class Intake:
    """New requests into the waiting queue, and the queue itself (docs/scheduler.md#intake)."""

    def __init__(
        self,
        config: SchedulerConfig,
        sizes: PoolSizes,
        registry: Registry,
        priority_sign: int,
        clock: QueueClock | None = None,
        watcher: QueueWatcher | None = None,
    ) -> None:
        self.config = config
        self.queue_clock = QueueClock() if clock is None else clock
        self.watcher = watcher
        self.sizes = sizes
        self.registry = registry
        self.priority_sign = priority_sign
        # In policy order after each prefill attempt, arrivals and re-queued requests at the end.
        self.waiting: list[Request] = []
        self._clock = 0

    def input_length_error(self, input_len: int) -> str | None:
        limit = self.sizes.max_req_input_len
        if input_len >= limit:
            return (
                f"Input length ({input_len} tokens) exceeds the maximum allowed length "
                f"({limit} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
        return None

    def add_request(self, rid: str, input_ids: Sequence[int], params: RequestParams, uid: int = 0) -> Request:
        """Queue a new request. Raises QueueFull / RequestRejected; ValueError for a duplicate rid."""
        if rid in self.registry.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        sizes = self.sizes
        ids = list(input_ids)
        error = self.input_length_error(len(ids))
        if error is not None and self.config.allow_auto_truncate:
            ids, error = ids[: sizes.max_req_input_len], None
        req = Request(rid=rid, origin_input_ids=ids, params=params, uid=uid)
        req.max_new_tokens = clamp_max_new_tokens(
            params.max_new_tokens,
            len(ids),
            sizes.max_req_len,
            sizes.capacity,
            sizes.page_size,
            self.config.max_new_tokens_limit,
        )
        req.min_new_tokens = min(params.min_new_tokens, req.max_new_tokens)
        req.priority = self._intake_priority(params.priority)
        if error is not None:
            # SGLang queues it with the prompt cut to one token so it finishes after one cheap prefill;
            # with nothing to compute we can finish it at once.
            self.registry.add(req)
            self.registry.finish(req, FinishReason.abort(error, AbortCode.INVALID))
            return req
        self.add_to_queue(req)
        self.registry.add(req)
        return req

    def _intake_priority(self, priority: int | None) -> int | None:
        if not self.config.enable_priority_scheduling:
            if priority is not None and self.config.abort_on_priority_when_disabled:
                raise RequestRejected("priority: priority scheduling is disabled on this server")
            return priority
        if priority is not None:
            return priority
        return MAX_INT if self.config.schedule_low_priority_values_first else -MAX_INT - 1

    # --- the waiting queue ---------------------------------------------------------------------------

    def add_to_queue(self, req: Request) -> None:
        """Append to the waiting queue, applying the queue cap (docs/scheduler.md#intake
        _abort_on_queued_limit). Raises QueueFull."""
        cap = self.config.max_queued_requests
        if cap is not None and len(self.waiting) + 1 > cap:
            victim = self._queue_victim(req)
            if victim is None:
                raise QueueFull(QUEUE_FULL)
            self.remove(victim)
            self.registry.finish(victim, FinishReason.abort(PRIORITY_EVICTED))
        self._clock += 1
        req.wait_queue_entry_time = self._clock
        req.queue_entry_s = self.queue_clock.busy_s
        req.queue_entry_tokens = self.queue_clock.prefill_tokens
        self.waiting.append(req)
        if self.watcher is not None:
            self.watcher.joined(req)

    def _queue_victim(self, newcomer: Request) -> Request | None:
        if not self.config.enable_priority_scheduling or not self.waiting:
            return None
        d = self.priority_sign
        victim = max(self.waiting, key=lambda r: (urgency(r, d), r.wait_queue_entry_time))
        if urgency(newcomer, d) < urgency(victim, d):
            return victim
        return None

    def requeue(self, req: Request) -> None:
        """Back into the queue after a retraction or preemption; aborted when the queue is full."""
        try:
            self.add_to_queue(req)
        except QueueFull:
            self.registry.finish(req, FinishReason.abort(QUEUE_FULL))

    def is_waiting(self, req: Request) -> bool:
        return req in self.waiting

    def remove(self, req: Request) -> None:
        self.waiting.remove(req)
        if self.watcher is not None:
            self.watcher.left(req)

    def order(self, policy: Policy, running: Sequence[Request]) -> None:
        """Reorder the queue for this prefill attempt (docs/scheduler.md#ordering-policies calc_priority)."""
        policy.order(self.waiting, running)

    def remove_admitted(self, admitted: Collection[int]) -> None:
        """Drop the requests (by id()) admitted in this pass; the rest keep their order."""
        if self.watcher is None:
            self.waiting = [r for r in self.waiting if id(r) not in admitted]
            return
        waiting: list[Request] = []
        for r in self.waiting:
            if id(r) in admitted:
                self.watcher.left(r)
            else:
                waiting.append(r)
        self.waiting = waiting

    def pending_tokens(self) -> int:
        return sum(r.seqlen for r in self.waiting)
