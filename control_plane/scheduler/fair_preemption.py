"""Preemption for token fairness (docs/scheduler.md#fairness-preemption), `--fairness-preempt-bound B`.

VTC orders the waiting queue but admits only into the room running requests leave: a tenant that
floods holds the running slots and the KV pool, and a well-behaved tenant's request waits at the
head of the queue for them. With a bound B > 0, a waiting request that cannot be admitted (the
running batch is full, or its tokens do not fit) takes the room from running requests of tenants
whose counter is more than B weighted tokens above its own tenant's once its own prompt is charged
(so a preemption never lifts its tenant that far above the tenants level with it, who would take
the room back in turn): the most-served tenant's least-progressed requests first (the least work to
redo), released as a retraction releases them (KV freed, re-queued for a re-prefill). Only as many
as make its room: each victim counts what its release frees (the KV it holds and its reserved
decode), at most MAX_VICTIMS of them. Churn is bounded: a request gives way only after
MIN_RUN_TOKENS tokens since it was last admitted, so it is never preempted twice within that many of
its own steps.

With step isolation (isolation.py) the tenants above their share of the running batch (heavy) give
a slot to a request of a tenant that is not, whatever their counters: VTC's lift puts a returning
tenant level with the flood, so the bound alone would keep it waiting for a slot the flood holds.
Without a bound, one heavy request gives way per newcomer.
"""

from __future__ import annotations

from collections.abc import Callable

from control_plane.request import Request
from control_plane.scheduler.adder import PrefillAdder
from control_plane.scheduler.batch import RunningBatch
from control_plane.scheduler.fairness import VirtualCounters
from control_plane.scheduler.intake import Intake
from control_plane.scheduler.preemption import Preemption

# Tokens a request generates after an admission before fairness may preempt it (again).
MIN_RUN_TOKENS = 16
# Running requests one newcomer may preempt: more than that and it waits for room instead.
MAX_VICTIMS = 4


class FairPreemption:
    """Running requests of tenants far ahead giving way to a backlogged tenant's request (released
    as priority preemption releases them)."""

    def __init__(
        self,
        preemption: Preemption,
        running: RunningBatch,
        counters: VirtualCounters,
        intake: Intake,
        bound: float,
    ) -> None:
        self.preemption = preemption
        self.running = running
        self.counters = counters
        self.intake = intake
        self.bound = bound
        # Outputs each request had when fairness last preempted it, by rid (its run since counts from there).
        self.outputs_at: dict[str, int] = {}
        self.preempted_total = 0

    def preempt_for(
        self, req: Request, adder: PrefillAdder, preempted: list[Request], heavy: frozenset[str] = frozenset()
    ) -> bool:
        """Release running requests to make room for `req`; whether any were. `heavy`: the tenants
        above their share at this pass (isolation), who give way to any other tenant's request."""
        tenant = req.params.tenant
        if tenant in heavy:
            heavy = frozenset()
        if self.bound <= 0 and not heavy:
            return False
        counter = self.counters.counter
        # Ahead by more than B once `req`'s own prompt is charged: else its admission would put its
        # tenant that far above the tenants level with it, and their requests would take its room in
        # turn (on level tenants, one preemption per admission).
        floor = (
            counter(tenant) + self.counters.prompt_cost(req) + self.bound if self.bound > 0 else float("inf")
        )
        candidates = [
            r
            for r in self.running.reqs
            if not r.finished
            and not r.preempted
            and not r.params.group
            and r.num_outputs - self.outputs_at.get(r.rid, 0) >= MIN_RUN_TOKENS
        ]
        # Heavy tenants first, then the most-served tenant, within it the least progressed, then the newest.
        candidates.sort(
            key=lambda r: (
                r.params.tenant not in heavy,
                -counter(r.params.tenant),
                r.num_outputs - self.outputs_at.get(r.rid, 0),
                -r.wait_queue_entry_time,
            )
        )
        most = 1 if self.bound <= 0 else MAX_VICTIMS
        victims = self._victims(
            req,
            adder,
            candidates,
            lambda r: r.params.tenant in heavy or counter(r.params.tenant) > floor,
            most,
        )
        if victims is None:
            return False
        adder.give_way(victims)
        self._forget_ended()
        for victim in victims:
            self.outputs_at[victim.rid] = victim.num_outputs
        self.preempted_total += len(victims)
        self.preemption.release(victims, preempted)
        return True

    @staticmethod
    def _victims(
        req: Request,
        adder: PrefillAdder,
        candidates: list[Request],
        gives_way: Callable[[Request], bool],
        most: int,
    ) -> list[Request] | None:
        """The fewest leading candidates that give way and whose release makes room for `req`: each
        frees the KV it holds and its reserved decode. None when `most` of them do not (or none may
        give way): nothing is released for a room it would not get."""
        kv = adder.kv
        keep = req.last_node
        # Admitting `req` locks its match: what of it is evictable now counts against the room.
        short = adder.shortfall(req) + kv.lock_cost(keep)
        already = {id(r) for r in adder.preempt_list}
        chosen: list[Request] = []
        for cand in candidates:
            if id(cand) in already:
                continue
            if len(chosen) == most or not gives_way(cand):
                return None
            chosen.append(cand)
            short -= adder.offset(cand) + kv.release_gain(cand, keep)
            if short < 0:
                return chosen
        return None

    def _forget_ended(self) -> None:
        """Keep only live requests' marks (bounded by the requests live)."""
        if len(self.outputs_at) <= 2 * (len(self.running) + len(self.intake.waiting)) + 64:
            return
        live = {r.rid for r in self.running.reqs} | {r.rid for r in self.intake.waiting}
        self.outputs_at = {k: v for k, v in self.outputs_at.items() if k in live}
