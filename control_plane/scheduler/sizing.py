"""Sizes the scheduler derives from its worker: the pool and request limits, the running-request cap
(docs/scheduler.md#defaults) and the clamp on max_new_tokens at intake (docs/scheduler.md#intake)."""

from __future__ import annotations

from dataclasses import dataclass

from control_plane.config import SchedulerConfig
from protos.worker import WorkerLimits


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """One worker's pool as the scheduler sizes it (T, the page, the request length limits)."""

    page_size: int
    capacity: int
    max_req_len: int
    max_req_input_len: int
    max_running_requests: int

    @classmethod
    def of(cls, config: SchedulerConfig, limits: WorkerLimits) -> PoolSizes:
        page_size = config.page_size or limits.page_size
        capacity = limits.kv_capacity_tokens
        max_req_len = min(limits.max_context - 1, capacity - 1)
        return cls(
            page_size=page_size,
            capacity=capacity,
            max_req_len=max_req_len,
            # SGLang's max_req_len - 5, and with large pages also short of a page below the pool: a
            # longer prompt passes the length check but never the adder's gate (input + page < pool),
            # so it would wait forever; it is refused at intake instead.
            max_req_input_len=min(max_req_len - 5, capacity - page_size),
            max_running_requests=resolve_max_running_requests(
                config.max_running_requests, capacity, limits.max_context
            ),
        )


def resolve_max_running_requests(configured: int | None, capacity: int, context_len: int) -> int:
    """SGLang's default: min(clamp(int(T / context · 512), 2048, 4096), T // 2)
    (docs/scheduler.md#defaults)."""
    if configured is not None:
        return max(1, min(configured, capacity // 2))
    default = min(max(int(capacity / context_len * 512), 2048), 4096)
    return max(1, min(default, capacity // 2))


def clamp_max_new_tokens(
    requested: int | None, input_len: int, max_req_len: int, capacity: int, page_size: int, limit: int | None
) -> int:
    """docs/scheduler.md#intake: any admitted request can pass the adder's total-token gate on an empty
    pool."""
    wanted = requested if requested is not None else 2**30
    if limit is not None and limit > 0:
        wanted = min(wanted, limit)
    ceil_input = -(-input_len // page_size) * page_size
    return max(0, min(wanted, max_req_len - input_len - 1, capacity - ceil_input - page_size - 1))
