"""Intake (docs/scheduler.md#intake): length checks, the max_new_tokens clamp, priorities at the door, and
the waiting-queue cap."""

from __future__ import annotations

from collections.abc import Sequence

from control_plane.request import AbortCode, FinishReason, Request, RequestParams
from control_plane.scheduler.priority import urgency
from control_plane.scheduler.sizing import clamp_max_new_tokens
from control_plane.scheduler.state import MAX_INT, QueueFull, RequestRejected, SchedulerState

QUEUE_FULL = "The request queue is full."
PRIORITY_EVICTED = "The request is aborted by a higher priority request."


class Intake(SchedulerState):
    """New requests into the waiting queue (docs/scheduler.md#intake)."""

    def input_length_error(self, input_len: int) -> str | None:
        if input_len >= self.max_req_input_len:
            return (
                f"Input length ({input_len} tokens) exceeds the maximum allowed length "
                f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
        return None

    def add_request(self, rid: str, input_ids: Sequence[int], params: RequestParams, uid: int = 0) -> Request:
        """Queue a new request. Raises QueueFull / RequestRejected; ValueError for a duplicate rid.

        `uid` is the engine's opaque unsigned 64-bit key for the request's stream: it only labels the
        request's tokens in `take_updates` (not a scheduling input; replays pass 0)."""
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        ids = list(input_ids)
        error = self.input_length_error(len(ids))
        if error is not None and self.config.allow_auto_truncate:
            ids, error = ids[: self.max_req_input_len], None
        req = Request(rid=rid, origin_input_ids=ids, params=params, uid=uid)
        req.max_new_tokens = clamp_max_new_tokens(
            params.max_new_tokens,
            len(ids),
            self.max_req_len,
            self.capacity,
            self.page_size,
            self.config.max_new_tokens_limit,
        )
        req.min_new_tokens = min(params.min_new_tokens, req.max_new_tokens)
        req.priority = self._intake_priority(params.priority)
        if error is not None:
            # SGLang queues it with the prompt cut to one token so it finishes after one cheap prefill;
            # with nothing to compute we can finish it at once.
            self.requests[rid] = req
            self._finish(req, FinishReason.abort(error, AbortCode.INVALID))
            return req
        self._add_to_queue(req)
        self.requests[rid] = req
        return req

    def _intake_priority(self, priority: int | None) -> int | None:
        if not self.config.enable_priority_scheduling:
            if priority is not None and self.config.abort_on_priority_when_disabled:
                raise RequestRejected("priority: priority scheduling is disabled on this server")
            return priority
        if priority is not None:
            return priority
        return MAX_INT if self.config.schedule_low_priority_values_first else -MAX_INT - 1

    def _add_to_queue(self, req: Request) -> None:
        """Append to the waiting queue, applying the queue cap (docs/scheduler.md#intake
        _abort_on_queued_limit)."""
        cap = self.config.max_queued_requests
        if cap is not None and len(self.waiting) + 1 > cap:
            victim = self._queue_victim(req)
            if victim is None:
                raise QueueFull(QUEUE_FULL)
            self.waiting.remove(victim)
            self._finish(victim, FinishReason.abort(PRIORITY_EVICTED))
        req.wait_queue_entry_time = self._tick()
        self.waiting.append(req)

    def _queue_victim(self, newcomer: Request) -> Request | None:
        if not self.config.enable_priority_scheduling or not self.waiting:
            return None
        d = self.priority_sign
        victim = max(self.waiting, key=lambda r: (urgency(r, d), r.wait_queue_entry_time))
        if urgency(newcomer, d) < urgency(victim, d):
            return victim
        return None

    def _add_to_queue_or_abort(self, req: Request) -> None:
        try:
            self._add_to_queue(req)
        except QueueFull:
            self._finish(req, FinishReason.abort(QUEUE_FULL))
