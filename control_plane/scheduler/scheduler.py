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

from collections import deque
from collections.abc import Sequence

import numpy as np

from control_plane.cache.tree_node import TreeNode
from control_plane.config import SchedulerConfig
from control_plane.request import FinishReason, Request, RequestParams
from control_plane.scheduler.adder import AdderLimits
from control_plane.scheduler.admission import Admission
from control_plane.scheduler.batch import RunningBatch, ScheduledBatch
from control_plane.scheduler.books import SequenceBooks
from control_plane.scheduler.chunk import ChunkInProgress
from control_plane.scheduler.decode import Decode
from control_plane.scheduler.exits import Exits
from control_plane.scheduler.fair_preemption import FairPreemption
from control_plane.scheduler.fairness import FairOrder, QueueWatchers, VirtualCounters
from control_plane.scheduler.intake import PRIORITY_EVICTED, QUEUE_FULL, Intake, QueueWatcher
from control_plane.scheduler.isolation import StepIsolation
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.planning import PlanBuilder
from control_plane.scheduler.policy import make_policy, prefix_matcher, queue_watcher
from control_plane.scheduler.preemption import Preemption
from control_plane.scheduler.priority import priority_sign
from control_plane.scheduler.queue_clock import QueueClock
from control_plane.scheduler.ratio import NewTokenRatioTracker
from control_plane.scheduler.records import (
    MAX_INT,
    QueueFull,
    RequestFinished,
    RequestRejected,
    StepStats,
    StepUpdates,
    TokenBatch,
)
from control_plane.scheduler.registry import Registry
from control_plane.scheduler.results import ResultApplier
from control_plane.scheduler.retraction import HOST_POOL_FULL, OOM_LAST_REQUEST, Emigrant, Retraction
from control_plane.scheduler.sizing import PoolSizes, clamp_max_new_tokens, resolve_max_running_requests
from control_plane.scheduler.slo import SloAdmission, SloUnmeetable
from protos.worker import KvReceive, KvSend, StepKind, StepPlan, StepResult, WorkerLimits

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
    "SloUnmeetable",
    "StepStats",
    "StepUpdates",
    "TokenBatch",
    "clamp_max_new_tokens",
    "resolve_max_running_requests",
]


class Scheduler:
    """SGLang's scheduler for one worker's pool. Every public method is deterministic given the call
    sequence.

    It is composed of one object per piece of state, each the only writer of its own attributes
    (tests/control_plane/scheduler/test_scheduler_ownership.py): the running batch (batch.py, with its
    batch_is_full), the waiting queue (intake.py), the chunk in progress (chunk.py), the live requests
    and the updates to publish (registry.py), the books of what the worker holds (books.py), and the
    KV pool (kv.py). The rules act on them: admission (admission.py, with the PrefillAdder of
    adder.py and priority preemption, preemption.py), the decode step (decode.py) and retraction
    (retraction.py), ending requests (exits.py), the plan (planning.py) and applying a result
    (results.py). The step itself, SGLang's get_next_batch_to_run, is `next_plan` here."""

    def __init__(self, config: SchedulerConfig, limits: WorkerLimits) -> None:
        self.config = config
        self.limits = limits
        self.sizes = sizes = PoolSizes.of(config, limits)
        self.kv = KvManager(
            sizes.capacity,
            sizes.page_size,
            sizes.max_running_requests,
            limits.max_context,
            disable_radix_cache=config.disable_radix_cache,
            eviction_policy=config.radix_eviction_policy,
            low_priority_values_first=config.schedule_low_priority_values_first,
        )
        self.queue_clock = QueueClock()
        self.policy = make_policy(config, self.kv, self.queue_clock)
        matcher = prefix_matcher(self.policy)
        if config.full_prefix_dedup and matcher is not None:
            matcher.in_flight = self._prefills_in_flight
        # Token fairness (docs/scheduler.md#fairness): None with --fairness none, SGLang's behaviour.
        self.fairness: VirtualCounters | None = None
        watcher: QueueWatcher | None = queue_watcher(self.policy)
        if config.fairness != "none":
            self.fairness = VirtualCounters(config, self._tenants_holding)
            bound = config.fairness_locality_bound if config.fairness == "vtc-locality" else 0.0
            self.policy = FairOrder(self.policy, self.fairness, bound)
            watcher = QueueWatchers(watcher, self.fairness)
        self.ratio = NewTokenRatioTracker.from_config(config)
        self.adder_limits = AdderLimits(
            page_size=sizes.page_size,
            max_prefill_tokens=config.max_prefill_tokens,
            chunked_prefill_size=config.chunked_prefill_size if config.chunking_enabled else None,
            clip_max_new_tokens=config.clip_max_new_tokens,
            prefill_max_requests=config.prefill_max_requests,
            priority_threshold=config.priority_scheduling_preemption_threshold,
            low_priority_values_first=config.schedule_low_priority_values_first,
        )
        sign = priority_sign(config.schedule_low_priority_values_first)
        self.running = RunningBatch(self.kv.columns)
        self.seq_books = SequenceBooks(limits.host_pool_capacity_tokens)
        self.registry = Registry(self.seq_books)
        self.intake = Intake(config, sizes, self.registry, sign, self.queue_clock, watcher)
        self.chunk = ChunkInProgress()
        self.exits = Exits(self.kv, self.registry, self.intake, self.chunk)
        self.retraction = Retraction(
            config,
            self.kv,
            self.seq_books,
            self.registry,
            self.intake,
            self.exits,
            self.running,
            self.ratio,
            sign,
            self.fairness,
        )
        preemption = Preemption(self.running, self.retraction, sign)
        # Preemption for fairness (docs/scheduler.md#fairness-preemption): None unless a bound is set.
        self.fair_preemption: FairPreemption | None = None
        # Isolation makes heavy tenants give way to the others (fair_preemption.py), with or without a bound.
        if self.fairness is not None and (
            config.fairness_preempt_bound > 0 or config.fairness_isolation_tokens > 0
        ):
            self.fair_preemption = FairPreemption(
                preemption, self.running, self.fairness, self.intake, config.fairness_preempt_bound
            )
        # Step isolation (docs/scheduler.md#fairness-isolation): None unless --fairness-isolation-tokens.
        self.isolation: StepIsolation | None = None
        if self.fairness is not None and config.fairness_isolation_tokens > 0:
            self.isolation = StepIsolation(config, self.fairness, self.queue_clock)
        self.decode = Decode(config, self.kv, self.seq_books, self.running, self.retraction, self.ratio)
        self.admission = Admission(
            config,
            self.adder_limits,
            sizes.max_running_requests,
            self.kv,
            self.policy,
            self.ratio,
            self.running,
            self.intake,
            self.seq_books,
            self.exits,
            self.chunk,
            preemption,
            self.decode,
            self.fair_preemption,
            self.isolation,
        )
        # Every planned batch whose result is not applied yet, oldest first (overlap scheduling keeps
        # more than one, docs/scheduler.md#overlap); SLO admission reads it.
        self._in_flight: deque[ScheduledBatch] = deque()
        # SLO admission (docs/scheduler.md#slo-admission): None without --slo-cost.
        self.slo: SloAdmission | None = None
        if config.slo_cost:
            self.slo = SloAdmission(
                config,
                self.kv,
                self.intake,
                self.running,
                self.chunk,
                self.queue_clock,
                self.seq_books,
                self._in_flight,
            )
        self.planner = PlanBuilder(self.kv, self.seq_books)
        self.results = ResultApplier(self.kv, self.registry, self.seq_books, self.exits, limits.eos_token_ids)
        # The batch most recently planned (docs/scheduler.md#step-loop step 4 merges it).
        self.last_batch: ScheduledBatch | None = None
        # Batches launched (SGLang's forward_ct: TEST_RETRACT retracts every interval-th), and plans made.
        self.forward_ct = 0
        self.step_id = 0
        self.last_stats: StepStats | None = None
        # Pre-copied prefixes locked until their request comes (import_kv's hold), by transfer id.
        self._holds: dict[str, TreeNode] = {}

    # --- the step (docs/scheduler.md#step-loop get_next_batch_to_run) ------------------------------------

    def next_plan(self, always: bool = False) -> StepPlan | None:
        """Decide the next step. Returns None when there is nothing to do (not even a release),
        unless `always`: then a plan that does nothing, for the worker to answer at once (the engine
        waits for its word on a KV transfer, docs/migration.md).

        Earlier plans may still be in flight; every plan returned must get its result applied, in
        plan order."""
        self.retraction.emigrants_planned()
        self.admission.process_pending_chunked_abort()
        self.admission.stash_chunked_req()
        self._merge_last_batch()
        stats = StepStats(step_id=self.step_id + 1, kind=StepKind.PREFILL)
        batch = self.admission.get_new_batch_prefill(stats)
        if batch is None and len(self.running):
            batch = self.decode.update_running_batch(stats, self.forward_ct)
        self.last_batch = batch
        if batch is None and not self.seq_books.has_deltas and not always:
            return None
        self.step_id += 1
        if batch is not None:
            self.forward_ct += 1
            if batch.kind is not StepKind.DECODE:
                self.queue_clock.prefilled(stats.new_tokens)
            if self.fairness is not None:
                self.fairness.planned(batch)
            if self.slo is not None:
                stats.tpot_at_risk = self.slo.planned(batch, stats.new_tokens)
        stats.queued = len(self.intake.waiting)
        stats.new_token_ratio = self.ratio.current
        self.last_stats = stats
        plan = self.planner.build(self.step_id, batch)
        self._in_flight.append(batch if batch is not None else ScheduledBatch(plan.kind, plan.step_id))
        return plan

    def _prefills_in_flight(self) -> list[Request]:
        """The requests of the extend batches planned whose result is not applied yet: their KV is
        not in the tree (--full-prefix-dedup)."""
        reqs = [r for batch in self._in_flight if batch.is_extend for r in batch.extend_reqs]
        chunked = self.chunk.req
        return reqs if chunked is None or chunked in reqs else [*reqs, chunked]

    def _tenants_holding(self) -> list[str]:
        """The tenants of the requests a plan may still charge outside the waiting queue (running,
        mid-chunk, the last batch not merged yet, the plans in flight), one per request
        (VirtualCounters forgets the others' idle tenants)."""
        reqs = list(self.running.reqs)
        if self.chunk.req is not None:
            reqs.append(self.chunk.req)
        batches = [*self._in_flight, self.last_batch] if self.last_batch is not None else self._in_flight
        for batch in batches:
            reqs += batch.extend_reqs
            reqs += batch.decode_reqs.tolist()
        return [r.params.tenant for r in reqs]

    def _merge_last_batch(self) -> None:
        """docs/scheduler.md#step-loop step 4: the last extend batch's requests join the running
        batch, unless finished or still mid-chunk. Under overlap their prefill may still be in flight:
        they are decoded before their first token is known (docs/scheduler.md#overlap (c)). A request
        with max_new_tokens 0 only needs its prefill (SGLang never decodes a prefill-only batch): it
        ends when that result is applied."""
        last = self.last_batch
        if last is None or not last.is_extend:
            return
        chunked = self.chunk.req
        extended = [
            r for r in last.extend_reqs if not r.finished and r is not chunked and r.max_new_tokens > 0
        ]
        decoded = self.kv.columns.serial[last.decode_rows] == last.decode_serials
        survivors = len(extended) + int(np.count_nonzero(decoded))
        # batch_is_full belongs to the batch (docs/scheduler.md#batch-is-full): it is cleared when the
        # last batch lost members, and when the running batch is empty, since SGLang then makes the last
        # batch the running batch and with it that batch's own flag, which is False (after every mixed
        # step, too: a mixed step empties the running batch, docs/scheduler.md#mixed-chunk).
        if not len(self.running) or survivors != len(last.extend_reqs) + len(last.decode_rows):
            self.running.clear_full()
        if extended:
            self.running.merge(extended)
        if decoded.any():
            self.running.append(
                last.decode_reqs[decoded], last.decode_rows[decoded], last.decode_serials[decoded]
            )

    def apply_result(self, result: StepResult) -> None:
        """Apply `result` to the oldest plan in flight: append sampled tokens, run finish checks,
        cache or free the KV of finished requests. ValueError (nothing changed) when it is not that
        plan's result or does not carry one token per sampled entry."""
        batch = self._oldest_in_flight(result)
        self._in_flight.popleft()
        self.queue_clock.worked(result.forward_s)
        if self.fairness is not None:
            self.fairness.applied(batch)
        self.results.process_batch_result(
            batch, result.token_ids, result.logprobs, result.prompt_scores, result.grammar_failed
        )

    def _oldest_in_flight(self, result: StepResult) -> ScheduledBatch:
        if not self._in_flight:
            raise ValueError(f"result for step {result.step_id}, but no plan is in flight")
        batch = self._in_flight[0]
        if result.step_id != batch.step_id:
            raise ValueError(
                f"result for step {result.step_id}, but the oldest plan in flight is {batch.step_id}"
            )
        if len(result.token_ids) != batch.sampled_tokens:
            raise ValueError(
                f"step {batch.step_id}: result carries {len(result.token_ids)} tokens, "
                f"the plan sampled {batch.sampled_tokens}"
            )
        return batch

    # --- requests in and out -------------------------------------------------------------------------------

    def input_length_error(self, input_len: int) -> str | None:
        return self.intake.input_length_error(input_len)

    def add_request(self, rid: str, input_ids: Sequence[int], params: RequestParams, uid: int = 0) -> Request:
        """Queue a new request. Raises QueueFull / RequestRejected; ValueError for a duplicate rid.

        `uid` is the engine's opaque unsigned 64-bit key for the request's stream: it only labels the
        request's tokens in `take_updates` (not a scheduling input; replays pass 0)."""
        if self.slo is not None:
            self.slo.check(rid, input_ids, params)
        return self.intake.add_request(rid, input_ids, params, uid)

    def abort(self, rid: str, reason: FinishReason) -> bool:
        """Abort a live request (docs/scheduler.md#aborts): its finish is published now; a queued one
        leaves the queue, the one mid-chunk frees its KV in the next plan, any other stays in its batch
        with its KV until its next result, then ends with its KV cached."""
        return self.exits.abort(rid, reason)

    def finish(self, rid: str, reason: FinishReason) -> bool:
        """Finish a running request for a reason decided outside (a stop string); caches its KV."""
        return self.exits.finish(rid, reason)

    def send_kv(self, rid: str, transfer_id: str, address: str) -> int:
        """A migration's pre-copy (docs/migration.md): the next plan sends the KV of a running
        request's committed positions (page-aligned) to `address` as `transfer_id`, while the
        request goes on running here. Returns how many positions; 0, with nothing queued, when it
        is not running here or has not a page of them."""
        req = self.running_request(rid)
        if req is None:
            return 0
        n = req.kv_committed_len - req.kv_committed_len % self.page_size
        if n <= 0:
            return 0
        self.seq_books.send(KvSend(transfer_id, address, self.kv.row(req)[:n].copy()))
        return n

    def export(
        self, rid: str, reason: FinishReason, transfer_id: str, address: str, start: int = 0
    ) -> np.ndarray | None:
        """Finish a running request that continues on another worker (a migration, docs/migration.md):
        its KV is cached here as at any finish, so its prefix stays, and the next plan sends the
        cached part from position `start` on (what a pre-copy did not send) to `address` as
        `transfer_id` (a send reads its slots before that plan reuses any). Returns the slots of
        the whole cached part, positions [0, len); nothing is sent when len <= start (the cache is
        disabled, or the pre-copy sent it all). None when it is not running here (queued, mid-chunk
        or gone): nothing changed."""
        req = self.exits.running(rid)
        if req is None:
            return None
        tokens = np.array(req.fill_ids[: req.kv_committed_len], dtype=np.int64)
        self.exits.end(req, reason)
        slots = self.kv.cached_slots(tokens)
        if len(slots) > start:
            self.seq_books.send(KvSend(transfer_id, address, slots[start:].copy()))
        return slots

    def spill_to(self, address: str, tokens: int) -> None:
        """Until changed, a decode that does not fit sends the requests it would retract to the
        worker at transfer `address`, with their KV, while they fit in its `tokens` free slots
        (docs/migration.md#balancing); the engine takes them from `emigrants` after each plan and
        continues them there. "" (or 0 tokens): retract as usual."""
        self.retraction.spill_to(address, tokens, f"{self.limits.worker_id}/spill")

    @property
    def emigrants(self) -> list[Emigrant]:
        """The requests the latest plan sent to the spill worker instead of retracting them."""
        return self.retraction.emigrants

    def import_kv(
        self, transfer_id: str, input_ids: Sequence[int], start: int = 0, hold: bool = False
    ) -> tuple[int, np.ndarray] | None:
        """KV another worker sent of positions [start, len) of the tokens `input_ids`, for a request
        that continues here: a place in the prefix cache (KvManager.import_prefix), written by the
        next plan's receive before any forward reads it; the request matches it at admission like
        any cached prefix. `hold`: the prefix stays locked under `transfer_id` (a pre-copy, until
        the request comes). Returns (tokens cached here already, slots received into), or None
        when there is no room or the tree lacks part of [0, start): the next plan then forgets the
        transfer. Empty `input_ids`: the transfer is given up; the next plan forgets it, or, if it
        was received with `hold`, its lock is released."""
        if not len(input_ids):
            held = self._holds.pop(transfer_id, None)
            if held is not None:
                self.kv.dec_lock(held)
            else:
                self.seq_books.receive(KvReceive(transfer_id, np.zeros(0, dtype=np.int64)))
            return None
        tokens = np.asarray(input_ids, dtype=np.int64)
        placed = self.kv.import_prefix(tokens, start)
        if placed is None or not len(placed[1]):
            self.seq_books.receive(KvReceive(transfer_id, np.zeros(0, dtype=np.int64)))
        else:
            self.seq_books.receive(KvReceive(transfer_id, placed[1], placed[0] - start))
        if placed is not None and hold:
            node = self.kv.tree.match_prefix(tokens[: placed[0] + len(placed[1])]).last_node
            self.kv.inc_lock(node)
            self._holds[transfer_id] = node
        return placed

    def take_updates(self) -> StepUpdates:
        """Tokens and finishes since the last call (tokens first: see StepUpdates)."""
        return self.registry.take_updates()

    # --- state, read-only ----------------------------------------------------------------------------------

    def running_request(self, rid: str) -> Request | None:
        """The live request `rid` if it holds KV here and is past its prefill's planning: not queued
        and not mid-chunk (what `finish`, `send_kv` and `export` take)."""
        return self.exits.running(rid)

    def decode_headroom(self, steps: int) -> int:
        """Free and evictable slots left once the running requests have decoded `steps` more tokens
        each (at most their remaining max_new_tokens); negative: that many are missing, so unless
        requests end sooner a decode within `steps` steps retracts (the balancer's look-ahead)."""
        running = self.running
        supply = self.kv.available_size() + self.kv.evictable_size()
        if not len(running):
            return supply
        # The live requests' columns (RunningBatch.remaining_new_tokens less its finished-request
        # fix-up, which only finished ones need): the fleet asks after every step, mostly of a few
        # requests, where each numpy call's fixed cost is what counts (hence no np.clip either).
        live = running.live_mask()
        rows = running.rows if live.all() else running.rows[live]
        columns = self.kv.columns
        growth = np.minimum(np.maximum(columns.max_new[rows] - columns.n_out[rows], 0), steps)
        return supply - self.kv.growth_need(columns.allocated[rows], growth)

    def retraction_order(self) -> list[str]:
        """The running requests' ids, the first that a retraction would release first."""
        reqs = self.running.reqs
        live = self.running.live_mask()
        return [reqs[i].rid for i in reversed(self.retraction.order()) if live[i]]

    @property
    def waiting(self) -> list[Request]:
        return self.intake.waiting

    @property
    def requests(self) -> dict[str, Request]:
        return self.registry.requests

    @property
    def chunked_req(self) -> Request | None:
        return self.chunk.req

    @property
    def batch_is_full(self) -> bool:
        return self.running.batch_is_full

    @property
    def page_size(self) -> int:
        return self.sizes.page_size

    @property
    def capacity(self) -> int:
        return self.sizes.capacity

    @property
    def max_req_len(self) -> int:
        return self.sizes.max_req_len

    @property
    def max_req_input_len(self) -> int:
        return self.sizes.max_req_input_len

    @property
    def max_running_requests(self) -> int:
        return self.sizes.max_running_requests

    @property
    def by_handle(self) -> dict[int, Request]:
        return self.seq_books.by_handle

    @property
    def host_used(self) -> int:
        return self.seq_books.host_used

    @property
    def offloaded(self) -> dict[int, Request]:
        return self.seq_books.offloaded

    @property
    def num_retracted_total(self) -> int:
        """Requests retracted so far (GetServerInfo)."""
        return self.retraction.num_retracted_total

    @property
    def in_flight(self) -> int:
        """Plans returned by next_plan whose results are not applied yet."""
        return len(self._in_flight)

    @property
    def is_idle(self) -> bool:
        return (
            not self.intake.waiting
            and not len(self.running)
            and self.chunk.req is None
            and not self.registry.requests
            and not self._in_flight
        )

    def on_idle(self) -> None:
        """Fully idle: reset the new-token ratio (docs/scheduler.md#idle)."""
        self.ratio.reset()

    def books(self) -> tuple[int, int]:
        """(live sequences, Σ slots in their slot tables) that the worker must report after running
        the most recently planned plan. Valid right after next_plan returned a plan; O(1)."""
        return len(self.seq_books.by_handle), self.seq_books.seq_slots

    def live_handles(self) -> int:
        return len(self.seq_books.by_handle)

    def live_seq_slots(self) -> int:
        """Σ slots in the worker's tables of live sequences, after the most recent plan (books()[1])."""
        return self.seq_books.seq_slots

    def private_slots(self) -> int:
        """Slots held by live requests and not owned by the tree (whole pages), decodes in flight
        included. O(live requests): for invariant checks."""
        return self.seq_books.private_slots(self.sizes.page_size)

    def pending_tokens(self) -> int:
        chunked = self.chunk.req
        return self.intake.pending_tokens() + (chunked.seqlen - chunked.extend_range[1] if chunked else 0)

    def live_requests(self) -> list[Request]:
        """Every request not yet finished, with its output_ids synced (failover continues each one
        from prompt + output_ids)."""
        self.kv.columns.sync_all()
        return list(self.registry.requests.values())
