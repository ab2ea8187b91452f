"""Retraction (docs/scheduler.md#retraction): what gives way when the next decode does not fit. The
retraction order, the OOM abort of the last request, sample groups aborted whole, and the release
of a retracted or preempted request for a later re-prefill, through the host backup pool when there
is one (docs/scheduler.md#host-backup-pool)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from control_plane.config import SchedulerConfig
from control_plane.request import AbortCode, FinishReason, Request
from control_plane.scheduler.batch import RunningBatch
from control_plane.scheduler.books import SequenceBooks
from control_plane.scheduler.exits import Exits
from control_plane.scheduler.fairness import VirtualCounters
from control_plane.scheduler.intake import Intake
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.priority import urgency
from control_plane.scheduler.ratio import NewTokenRatioTracker
from control_plane.scheduler.records import StepStats
from control_plane.scheduler.registry import Registry
from protos.worker import KvSend

HOST_POOL_FULL = (
    "KV cache pool is full and the host backup pool has no room for this request's {n} tokens: "
    "aborted instead of retracted."
)
GROUP_ABORTED = "KV cache pool is full: the sample group was aborted together."
OOM_LAST_REQUEST = (
    "Out of memory even after retracting all other requests in the decode batch. Aborting the last request."
)


# Why a request that a retraction sent to another worker with its KV left this scheduler (never
# published: its stream goes on there).
EMIGRATED = FinishReason.abort("continued on another worker (migrated instead of retracted)")


@dataclass(slots=True)
class Spill:
    """Where a retraction sends requests instead of releasing them for a re-prefill
    (docs/migration.md#balancing): another worker's transfer address, the slots it has room for
    (used up as requests go), and the prefix of the transfer ids."""

    address: str
    tokens: int
    prefix: str


@dataclass(frozen=True, slots=True)
class Emigrant:
    """A request a retraction sent to the spill worker: finished here (EMIGRATED) with its KV cached,
    and the plan sends the cached part, the KV of `tokens`, as `transfer_id` ("" when nothing was
    cached: it is recomputed there)."""

    req: Request
    transfer_id: str
    tokens: tuple[int, ...]


class Retraction:
    """Running requests released for a later re-prefill (SGLang's retract_decode and release_req)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KvManager,
        books: SequenceBooks,
        registry: Registry,
        intake: Intake,
        exits: Exits,
        running: RunningBatch,
        ratio: NewTokenRatioTracker,
        priority_sign: int,
        fairness: VirtualCounters | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.books = books
        self.registry = registry
        self.intake = intake
        self.exits = exits
        self.running = running
        self.ratio = ratio
        self.priority_sign = priority_sign
        # With token fairness the most-served tenant's requests give way first.
        self.fairness = fairness
        # Requests retracted so far (GetServerInfo).
        self.num_retracted_total = 0
        # Set by Scheduler.spill_to; the requests sent there by the latest plan.
        self.spill: Spill | None = None
        self.emigrants: list[Emigrant] = []

    def retract_decode(self, stats: StepStats) -> None:
        """Retract from the least worth keeping until the rest's next decode fits (at least one, the
        TEST_RETRACT switch included); re-queue them and re-estimate the new-token ratio."""
        reqs = self.running.reqs
        order = self.order()
        available_before = self.kv.available_size()
        stats.ratio_before_retract = self.ratio.current
        retracted: list[Request] = []
        first = True
        while first or not self.kv.check_decode_mem(self.running.seq_lens[order]):
            if len(order) == 1:
                break
            if reqs[order[-1]].params.group and not stats.kv_full:
                break  # TEST_RETRACT exercises retraction; a sample group is never partially retracted
            victim = reqs[order.pop()]
            first = False
            if victim.params.group:
                order = self._abort_group(victim, order)
                continue
            if self._emigrate(victim, stats.step_id):
                continue
            if self.release_for_requeue(victim, remaining=len(order)):
                retracted.append(victim)
        if len(order) == 1 and not self.kv.check_decode_mem(self.running.seq_lens[order]):
            last = reqs[order.pop()]
            self.kv.release_req(last, 0, self.config.retract_decode_steps)
            reason = FinishReason.abort(OOM_LAST_REQUEST, AbortCode.INTERNAL)
            self.registry.finish(last, reason)
            stats.oom_aborted.append(last.rid)
            if last.params.group:
                self.exits.abort_group_elsewhere(last.params.group, reason)
        self.running.keep(order)
        self.ratio.after_retract(self.running.reqs, self.config.retract_decode_steps)
        for req in retracted:
            self.num_retracted_total += 1
            self.intake.requeue(req)
        stats.retracted = [r.rid for r in retracted]
        stats.retracted_input_tokens = sum(len(r.origin_input_ids) for r in retracted)
        stats.retracted_output_tokens = sum(r.num_outputs for r in retracted)
        stats.retract_tokens_gained = self.kv.available_size() - available_before

    def spill_to(self, address: str, tokens: int, prefix: str) -> None:
        """Scheduler.spill_to: victims go to `address` while they fit in `tokens` ("": none)."""
        self.spill = Spill(address, tokens, prefix) if address and tokens > 0 else None

    def emigrants_planned(self) -> None:
        """A new plan begins: the previous one's emigrants were taken."""
        self.emigrants = []

    def _emigrate(self, req: Request, step: int) -> bool:
        """Instead of a retraction: the request continues on the spill worker with its KV, when that
        has room for it and its next retract_decode_steps tokens. It finishes here like a migrated
        request (its KV cached, so the decode check can evict it), and this plan sends the cached
        part before anything reuses its slots. False: no spill worker, no room there, or a request
        still scoring its prompt (its rows would be lost)."""
        spill = self.spill
        # An aborted request (marked, docs/scheduler.md#aborts) has no client to continue for.
        if spill is None or req.scores_pending or req.to_finish is not None:
            return False
        need = req.kv_committed_len + self.config.retract_decode_steps
        if need > spill.tokens:
            return False
        spill.tokens -= need
        tokens = np.array(req.fill_ids[: req.kv_committed_len], dtype=np.int64)
        self.exits.end(req, EMIGRATED)
        slots = self.kv.cached_slots(tokens)
        transfer_id = f"{spill.prefix}/{step}/{req.rid}" if len(slots) else ""
        if transfer_id:
            self.books.send(KvSend(transfer_id, spill.address, slots.copy()))
        self.emigrants.append(Emigrant(req, transfer_id, tuple(tokens[: len(slots)].tolist())))
        return True

    def order(self) -> list[int]:
        """Indices, most worth keeping first; the loop retracts from the end
        (docs/scheduler.md#retraction)."""
        reqs = self.running.reqs
        sign = self.priority_sign

        def key(i: int) -> tuple[float, ...]:
            r = reqs[i]
            length_key = (r.num_outputs, -len(r.origin_input_ids))
            group_key: tuple[float, ...] = (1 if r.params.group else 0,)  # sample groups are kept first
            if self.fairness is not None:
                group_key = (*group_key, -self.fairness.counter(r.params.tenant))
            if self.config.retraction_policy == "priority":
                return (*group_key, -urgency(r, sign), *length_key)
            return (*group_key, *length_key)

        return sorted(range(len(reqs)), key=key, reverse=True)

    def _abort_group(self, victim: Request, order: list[int]) -> list[int]:
        """A parallel-sample group is never partially retracted: under pressure it is aborted whole,
        members still waiting or mid-chunk included."""
        reason = FinishReason.abort(GROUP_ABORTED)
        reqs = self.running.reqs
        members = [i for i in order if reqs[i].params.group == victim.params.group]
        for req in [victim, *(reqs[i] for i in members)]:
            self.exits.discard(req, reason)
        self.exits.abort_group_elsewhere(victim.params.group, reason)
        return [i for i in order if i not in set(members)]

    def release_for_requeue(self, req: Request, remaining: int) -> bool:
        """Release without inserting into the tree and reset for a later re-prefill (SGLang's
        release_req, docs/scheduler.md#retraction); `remaining` requests still run after it.

        With a host backup pool the KV is offloaded first and the worker keeps the handle (unless the
        request is still scoring its prompt); when the pool cannot hold it the request is aborted
        instead. Returns whether it is to be re-queued.
        """
        # A request still scoring its prompt re-prefills instead: rows of a plan in flight are
        # discarded with it, and a restored KV would skip their positions.
        backed_up = None if req.scores_pending else self.books.back_up(req, self.kv.row(req))
        self.kv.release_req(req, remaining, self.config.retract_decode_steps)
        if backed_up is False:
            self.registry.finish(req, FinishReason.abort(HOST_POOL_FULL.format(n=req.kv_committed_len)))
            return False
        if backed_up is None and req.handle >= 0:
            self.books.release(req)
        req.retraction_count += 1
        req.prefix_indices = np.zeros(0, dtype=np.int64)
        req.last_node = None
        req.cache_protected_len = 0
        req.extend_range = (0, 0)
        req.inflight_middle_chunks = 0
        req.is_retracted = True
        req.retracted_stain = True
        req.kv_committed_len = req.kv_allocated_len = 0
        return True
