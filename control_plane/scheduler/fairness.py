"""Token fairness between tenants (docs/scheduler.md#fairness): the Virtual Token Counter of Sheng
et al., "Fairness in Serving Large Language Models" (OSDI '24), and a locality-aware variant in the
spirit of DLPM (Cao et al. 2025).

`VirtualCounters` keeps each tenant's weighted service, charged from what the scheduler planned
(prompt tokens when their extend is planned, output tokens as results apply), divided by the
tenant's weight. It watches the waiting queue so that a tenant that becomes backlogged is lifted
(VTC's counter lift). It forgets a tenant that holds nothing (no request waiting, running, mid-chunk
or in a plan in flight) and whose counter is at or below every counter that can set a lift: those of
the tenants that hold something and of the tenant served last. A lift is the least backlogged
counter or the last served one's, and a tenant that joins is lifted at least to it, so no later lift
is below that level: the forgotten tenant, should it come back, is lifted where its counter would
have put it, and nothing else reads it meanwhile. Without API keys callers may name any tenant; the
table holds the tenants live and those ahead of them, not every name ever seen.

`FairOrder` wraps the configured policy: the policy orders the queue (its cache-aware order is kept
within each tenant), then the queue is merged tenant by tenant, always from the least-served one,
charging each pick's prompt as it goes, as VTC picks one request at a time. With a locality bound Q,
the pick is instead the first request in the policy's order whose tenant is within Q of the least
served (DLPM's bounded unfairness for prefix hits).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence

from control_plane.config import SchedulerConfig
from control_plane.request import Request
from control_plane.scheduler.batch import ScheduledBatch
from control_plane.scheduler.policy import Policy

# New tenants between sweeps for forgotten ones, at least (more as the table and the live requests grow).
FORGET_MIN = 64


class VirtualCounters:
    """Per-tenant counters of weighted served tokens, and which tenants are backlogged (waiting)."""

    def __init__(self, config: SchedulerConfig, holders: Callable[[], list[str]] | None = None) -> None:
        self.config = config
        self.prompt_weight = config.fairness_prompt_weight
        self.output_weight = config.fairness_output_weight
        self.counters: dict[str, float] = {}
        # Requests waiting per tenant: a tenant with any is backlogged.
        self.waiting: dict[str, int] = {}
        self.last_served = ""
        # The tenants of the requests outside the waiting queue that a plan may still charge (running,
        # mid-chunk, the batch just planned, the plans in flight), one entry per request (the
        # scheduler's). None: no tenant is ever forgotten.
        self.holders = holders
        # The table's size that starts the next sweep (amortized: at least the sweep's own work apart).
        self.forget_at = FORGET_MIN
        self.forgotten_total = 0

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def joined(self, req: Request) -> None:
        """A request entered the waiting queue: VTC's lift when its tenant becomes backlogged. A
        tenant's counter rises to the least counter among the backlogged tenants (none: the last
        served tenant's), so idling earns no credit to spend later."""
        tenant = req.params.tenant
        n = self.waiting.get(tenant, 0)
        if n == 0:
            backlogged = [self.counter(t) for t, k in self.waiting.items() if k > 0]
            floor = min(backlogged) if backlogged else self.counter(self.last_served)
            self.counters[tenant] = max(self.counter(tenant), floor)
        self.waiting[tenant] = n + 1

    def _forget(self) -> None:
        """Drop the tenants that hold nothing and whose counter is at or below every counter that can
        set a lift (module doc); costs the table and the live requests, and the next sweep waits for
        as many new tenants."""
        if self.holders is None:
            return
        holding = self.holders()
        live = set(holding)
        live.update(self.waiting)
        live.add(self.last_served)
        level = min(self.counter(t) for t in live)
        kept = {t: c for t, c in self.counters.items() if c > level or t in live}
        self.forgotten_total += len(self.counters) - len(kept)
        self.counters = kept
        self.forget_at = 2 * len(kept) + len(holding) + FORGET_MIN

    def left(self, req: Request) -> None:
        tenant = req.params.tenant
        n = self.waiting.get(tenant, 0) - 1
        if n > 0:
            self.waiting[tenant] = n
        else:
            self.waiting.pop(tenant, None)

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        if not prompt_tokens and not output_tokens:
            return
        cost = self.prompt_weight * prompt_tokens + self.output_weight * output_tokens
        self.counters[tenant] = self.counter(tenant) + cost / self.config.tenant_weight(tenant)
        self.last_served = tenant

    def planned(self, batch: ScheduledBatch) -> None:
        """A plan was made: its extends' prompt tokens are served (retracted work is charged again
        when recomputed: the worker computes it again)."""
        for req in batch.extend_reqs:
            start, end = req.extend_range
            self.charge(req.params.tenant, end - start, 0)
        # Swept here, with every admitted request in the batch just planned (while a pass admits, a
        # request is in none of the places the scheduler's holders name).
        if len(self.counters) >= self.forget_at:
            self._forget()

    def applied(self, batch: ScheduledBatch) -> None:
        """A plan's result is applied: one output token for each sampled extend and each decode."""
        for req, sampled in zip(batch.extend_reqs, batch.extend_sampled, strict=True):
            if sampled:
                self.charge(req.params.tenant, 0, 1)
        for req in batch.decode_reqs:
            self.charge(req.params.tenant, 0, 1)

    def prompt_cost(self, req: Request) -> float:
        """What admitting `req` now would add to its tenant's counter: its uncached prompt."""
        uncached = max(1, req.seqlen - req.num_matched_prefix_tokens)
        return self.prompt_weight * uncached / self.config.tenant_weight(req.params.tenant)


class FairOrder:
    """The configured policy's order, merged across tenants least-served first
    (docs/scheduler.md#fairness). `bound` 0: plain VTC; > 0: vtc-locality."""

    def __init__(self, inner: Policy, counters: VirtualCounters, bound: float) -> None:
        self.inner = inner
        self.cache_aware = inner.cache_aware
        self.counters = counters
        self.bound = bound

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        self.inner.order(queue, running)
        queue[:] = fair_merge(queue, self.counters, self.bound)


def fair_merge(queue: Sequence[Request], counters: VirtualCounters, bound: float) -> list[Request]:
    """`queue` (in the policy's order) re-merged: each next request is the head of the least-served
    tenant (projected: counters plus the prompts already picked in this merge), or with `bound` > 0
    the earliest head among tenants within `bound` of it. Ties: the earlier head. Each tenant's
    requests keep their relative order."""
    heads: dict[str, deque[tuple[int, Request]]] = {}
    for pos, req in enumerate(queue):
        heads.setdefault(req.params.tenant, deque()).append((pos, req))
    if len(heads) <= 1:
        return list(queue)
    if bound <= 0:
        return _least_first(heads, counters)
    projected = {t: counters.counter(t) for t in heads}
    out: list[Request] = []
    while heads:
        least = min(projected[t] for t in heads)
        eligible = [t for t in heads if projected[t] <= least + bound]
        tenant = min(eligible, key=lambda t: heads[t][0][0])
        _, req = heads[tenant].popleft()
        out.append(req)
        projected[tenant] += counters.prompt_cost(req)
        if not heads[tenant]:
            del heads[tenant]
    return out


def _least_first(heads: dict[str, deque[tuple[int, Request]]], counters: VirtualCounters) -> list[Request]:
    """fair_merge with no bound: a heap of (projected counter, head's place, tenant)."""
    heap = [(counters.counter(t), q[0][0], t) for t, q in heads.items()]
    heapq.heapify(heap)
    out: list[Request] = []
    while heap:
        projected, _, tenant = heap[0]
        queue = heads[tenant]
        _, req = queue.popleft()
        out.append(req)
        if queue:
            heapq.heapreplace(heap, (projected + counters.prompt_cost(req), queue[0][0], tenant))
        else:
            heapq.heappop(heap)
    return out


class QueueWatchers:
    """Several watchers of the waiting queue told alike (the kept matches and the counters)."""

    def __init__(self, *watchers: object) -> None:
        self.watchers = [w for w in watchers if w is not None]

    def joined(self, req: Request) -> None:
        for w in self.watchers:
            w.joined(req)  # type: ignore[attr-defined]

    def left(self, req: Request) -> None:
        for w in self.watchers:
            w.left(req)  # type: ignore[attr-defined]
