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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from control_plane.config import SchedulerConfig
from control_plane.request import AbortCode, FinishReason, Request, RequestParams
from control_plane.scheduler.adder import AdderLimits, AddReqResult, PrefillAdder
from control_plane.scheduler.batch import RunningBatch, ScheduledBatch
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.plan import (
    DecodeWork,
    ExtendWork,
    KvTransfer,
    NewSeq,
    SlotRemap,
    StepKind,
    StepPlan,
    StepResult,
    WorkerLimits,
)
from control_plane.scheduler.policy import make_policy
from control_plane.scheduler.ratio import NewTokenRatioTracker

QUEUE_FULL = "The request queue is full."
PRIORITY_EVICTED = "The request is aborted by a higher priority request."
HOST_POOL_FULL = (
    "KV cache pool is full and the host backup pool has no room for this request's {n} tokens: "
    "aborted instead of retracted."
)
OOM_LAST_REQUEST = (
    "Out of memory even after retracting all other requests in the decode batch. Aborting the last request."
)
MAX_INT = 2**63 - 1


class QueueFull(Exception):
    """The waiting queue is at --max-queued-requests and the newcomer may not displace anyone."""


class RequestRejected(Exception):
    """Refused at intake (e.g. a priority while priority scheduling is off)."""


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What changed for one request in a step: tokens to stream and, at the end, why it finished."""

    rid: str
    # Output tokens to stream (a matched EOS / stop token is not streamed).
    token_ids: tuple[int, ...] = ()
    finished: FinishReason | None = None
    # With `finished`: prompt tokens that were served from the prefix cache.
    cached_tokens: int = 0


@dataclass(slots=True)
class StepStats:
    """Per-step figures for the log lines (SCHEDULER.md §10) and the recorder."""

    step_id: int
    kind: StepKind
    new_seqs: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0
    running_at_admission: int = 0
    decode_bs: int = 0
    queued: int = 0
    pending_tokens: int = 0
    new_token_ratio: float = 0.0
    rem_total_tokens: float | None = None
    rem_input_tokens: int | None = None
    rem_chunk_tokens: int | None = None
    retracted: list[str] = field(default_factory=list)
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    retract_tokens_gained: int = 0
    ratio_before_retract: float = 0.0
    # Whether the retraction was forced by a full pool (else by the TEST_RETRACT switch).
    kv_full: bool = False


def resolve_max_running_requests(configured: int | None, capacity: int, context_len: int) -> int:
    """SGLang's default: min(clamp(int(T / context · 512), 2048, 4096), T // 2) (§9)."""
    if configured is not None:
        return max(1, min(configured, capacity // 2))
    default = min(max(int(capacity / context_len * 512), 2048), 4096)
    return max(1, min(default, capacity // 2))


def clamp_max_new_tokens(
    requested: int | None, input_len: int, max_req_len: int, capacity: int, page_size: int, limit: int | None
) -> int:
    """§1.5: any admitted request can pass the adder's total-token gate on an empty pool."""
    wanted = requested if requested is not None else 2**30
    if limit is not None and limit > 0:
        wanted = min(wanted, limit)
    ceil_input = -(-input_len // page_size) * page_size
    return max(0, min(wanted, max_req_len - input_len - 1, capacity - ceil_input - page_size - 1))


class Scheduler:
    """State for one worker's pool. Every public method is deterministic given the call sequence."""

    def __init__(self, config: SchedulerConfig, limits: WorkerLimits) -> None:
        self.config = config
        self.limits = limits
        self.page_size = config.page_size or limits.page_size
        self.capacity = limits.kv_capacity_tokens
        self.max_req_len = min(limits.max_context - 1, self.capacity - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.max_running_requests = resolve_max_running_requests(
            config.max_running_requests, self.capacity, limits.max_context
        )
        self.kv = KvManager(
            self.capacity,
            self.page_size,
            self.max_running_requests,
            limits.max_context,
            disable_radix_cache=config.disable_radix_cache,
            eviction_policy=config.radix_eviction_policy,
        )
        self.policy = make_policy(config, self.kv)
        self.ratio = NewTokenRatioTracker.from_config(config)
        self.adder_limits = AdderLimits(
            page_size=self.page_size,
            max_prefill_tokens=config.max_prefill_tokens,
            chunked_prefill_size=config.chunked_prefill_size if config.chunking_enabled else None,
            clip_max_new_tokens=config.clip_max_new_tokens,
            prefill_max_requests=config.prefill_max_requests,
            priority_threshold=config.priority_scheduling_preemption_threshold,
            low_priority_values_first=config.schedule_low_priority_values_first,
        )
        self.priority_sign = 1 if config.schedule_low_priority_values_first else -1
        self.preemption = config.enable_priority_scheduling and not config.disable_priority_preemption
        self.waiting: list[Request] = []
        self.running = RunningBatch()
        self.chunked_req: Request | None = None
        self.last_batch: ScheduledBatch | None = None
        self.batch_is_full = False
        self.forward_ct = 0
        self.step_id = 0
        self.requests: dict[str, Request] = {}
        self.by_handle: dict[int, Request] = {}
        self._clock = 0
        self._next_handle = 1
        self._pending_chunked_abort: FinishReason | None = None
        self._releases: list[int] = []
        # Host backup pool (SCHEDULER.md Appendix A): retracted requests' KV waits there, under the
        # request's handle, until re-admission restores it into fresh slots.
        self.host_capacity = limits.host_pool_capacity_tokens
        self.host_used = 0
        self.offloaded: dict[int, Request] = {}
        self._offloads: list[KvTransfer] = []
        self._restores: list[KvTransfer] = []
        self._remaps: list[SlotRemap] = []
        self._updates: list[RequestUpdate] = []
        # Handles introduced by the extend being planned (they get a NewSeq in the plan).
        self._introduced: set[int] = set()
        self._decode_slots = np.zeros(0, dtype=np.int64)
        self._decode_handles = np.zeros(0, dtype=np.int64)
        self.last_stats: StepStats | None = None
        # Requests retracted so far (GetServerInfo).
        self.num_retracted_total = 0

    # --- intake (§1.5) -------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def input_length_error(self, input_len: int) -> str | None:
        if input_len >= self.max_req_input_len:
            return (
                f"Input length ({input_len} tokens) exceeds the maximum allowed length "
                f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
        return None

    def add_request(self, rid: str, input_ids: Sequence[int], params: RequestParams) -> Request:
        """Queue a new request. Raises QueueFull / RequestRejected; ValueError for a duplicate rid."""
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        ids = list(input_ids)
        error = self.input_length_error(len(ids))
        if error is not None and self.config.allow_auto_truncate:
            ids, error = ids[: self.max_req_input_len], None
        req = Request(rid=rid, origin_input_ids=ids, params=params)
        req.max_new_tokens = clamp_max_new_tokens(
            params.max_new_tokens,
            len(ids),
            self.max_req_len,
            self.capacity,
            self.page_size,
            self.config.max_new_tokens_limit,
        )
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
        """Append to the waiting queue, applying the queue cap (§1.5 _abort_on_queued_limit)."""
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
        victim = max(self.waiting, key=lambda r: (d * _prio(r), r.wait_queue_entry_time))
        if d * _prio(newcomer) < d * _prio(victim):
            return victim
        return None

    # --- aborts and externally decided finishes -------------------------------------------------

    def abort(self, rid: str, reason: FinishReason) -> bool:
        """Abort a live request; its KV is freed now and its handle released in the next plan."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        if req is self.chunked_req:
            # Applied at the top of the next plan (SGLang's process_pending_chunked_abort).
            self._pending_chunked_abort = reason
            return True
        if req in self.waiting:
            # A queued request holds no KV (a retracted one gave it back; a backed-up one's host copy
            # goes with its handle).
            self.waiting.remove(req)
        else:
            self.kv.release_aborted(req)
        self._finish(req, reason)
        return True

    def finish(self, rid: str, reason: FinishReason) -> bool:
        """Finish a running request for a reason decided outside (a stop string); caches its KV."""
        req = self.requests.get(rid)
        if req is None or req.finished or req is self.chunked_req or req in self.waiting:
            return False
        self.kv.cache_finished_req(req, insert=True)
        self._finish(req, reason)
        return True

    def _finish(self, req: Request, reason: FinishReason, tokens: tuple[int, ...] = ()) -> None:
        req.finish(reason)
        if req.handle >= 0:
            self._release_handle(req)
        self.requests.pop(req.rid, None)
        self._updates.append(RequestUpdate(req.rid, tokens, reason, req.cached_tokens))

    def _release_handle(self, req: Request) -> None:
        """The worker forgets this sequence in the next plan (and drops any host backup of it)."""
        self._releases.append(req.handle)
        self.by_handle.pop(req.handle, None)
        if self.offloaded.pop(req.handle, None) is not None:
            self.host_used -= req.host_backup_len
            req.host_backup_len = 0
        req.handle = -1

    def take_updates(self) -> list[RequestUpdate]:
        updates, self._updates = self._updates, []
        return updates

    # --- the step (§1.3) ------------------------------------------------------------------------

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

    def _apply_pending_chunked_abort(self) -> None:
        req, reason = self.chunked_req, self._pending_chunked_abort
        if req is None or reason is None:
            return
        self._pending_chunked_abort = None
        self.chunked_req = None
        self.kv.release_aborted(req)
        self._finish(req, reason)

    def _stash_chunked_req(self, req: Request) -> None:
        if req.extend_range[1] > len(req.prefix_indices):
            self._push_remap(self.kv.cache_unfinished_req(req, chunked=True))

    def _push_remap(self, remap: SlotRemap | None) -> None:
        if remap is not None:
            self._remaps.append(remap)

    def _merge_last_batch(self) -> None:
        last = self.last_batch
        if last is None or not last.is_extend:
            return
        members = last.extend_reqs + last.decode_reqs
        survivors = [r for r in members if not r.finished and r is not self.chunked_req]
        if len(survivors) != len(members):
            self.batch_is_full = False
        if survivors:
            self.running.merge(survivors)

    # --- prefill (§3.5) -------------------------------------------------------------------------

    def _allocatable(self) -> int:
        return min(self.max_running_requests - len(self.running), self.kv.free_rows())

    def _get_new_batch_prefill(self, stats: StepStats) -> ScheduledBatch | None:
        if self.preemption:
            self.batch_is_full = False
        if (self.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        if self._allocatable() <= 0 and self.chunked_req is None and not self.preemption:
            self.batch_is_full = True
            return None
        self.policy.order(self.waiting, self.running.reqs)
        mixed = self.config.enable_mixed_chunk and len(self.running) > 0
        running_bs = len(self.running)
        adder = PrefillAdder(
            self.kv,
            self.adder_limits,
            self.running.reqs,
            self.ratio.current,
            mixed_decode_tokens=running_bs if mixed else 0,
        )
        chunked_before = self.chunked_req
        if self.chunked_req is not None:
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        preempted = self._admit_waiting(adder)
        if not adder.can_run_list:
            return None
        self._fill_stats(stats, adder, running_bs)
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        for req in preempted:
            self._add_to_queue_or_abort(req)
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None, "only one request may be mid-chunk"
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = ScheduledBatch(StepKind.PREFILL, list(adder.can_run_list), chunked_req=self.chunked_req)
        self._prepare_extend(batch.extend_reqs, chunked_before)
        if mixed:
            self._mix_with_running(batch, stats)
        return batch

    def _admit_waiting(self, adder: PrefillAdder) -> list[Request]:
        """The admission loop (§3.5 step 9). Returns requests preempted to make room."""
        preempted: list[Request] = []
        for req in self.waiting:
            if len(adder.can_run_list) >= self._allocatable():
                self.batch_is_full = True
            if self.batch_is_full and not (self.preemption and self._preempt_for(req, adder, preempted)):
                break
            self._init_next_round_input(req)
            ignore_eos_path = req.params.ignore_eos and self.kv.disabled
            result = adder.add_one_req(req, ignore_eos_path)
            if result is not AddReqResult.CONTINUE:
                if result is AddReqResult.NO_TOKEN:
                    self.batch_is_full = True
                break
        return preempted

    def _init_next_round_input(self, req: Request) -> None:
        if req.host_backup_len:
            # Its KV comes back from the host pool: no prefix match, no lock.
            req.prefix_indices, req.last_node, req.cache_protected_len = np.zeros(0, dtype=np.int64), None, 0
            return
        # A match never covers the last token: the prefill must produce logits (§3.1, §12.3).
        self.kv.match_prefix(req, max(req.seqlen - 1, 0))
        req.cache_protected_len = len(req.prefix_indices)

    def _preempt_for(self, req: Request, adder: PrefillAdder, preempted: list[Request]) -> bool:
        """Priority preemption (§2.4): release running requests that the newcomer outranks."""
        sign = self.priority_sign
        candidates = [r for r in self.running.reqs if not r.finished and not r.preempted]
        candidates.sort(key=lambda r: (_prio(r) * (-sign), -r.wait_queue_entry_time))
        self._init_next_round_input(req)
        victims = adder.preempt_to_schedule(req, candidates)
        if victims is None:
            return False
        victim_ids = {id(v) for v in victims}
        in_batch_order = [r for r in self.running.reqs if id(r) in victim_ids]
        for victim in in_batch_order:
            victim.preempted = True
            if self._release_for_requeue(victim, remaining=len(self.running) - len(victim_ids)):
                preempted.append(victim)
        self.running.remove(in_batch_order)
        self.batch_is_full = False
        return True

    def _fill_stats(self, stats: StepStats, adder: PrefillAdder, running_bs: int) -> None:
        stats.kind = StepKind.PREFILL
        stats.new_seqs = len(adder.can_run_list)
        stats.new_tokens = adder.log_input_tokens
        stats.cached_tokens = adder.log_hit_tokens
        stats.running_at_admission = running_bs
        stats.rem_total_tokens = adder.rem_total_tokens
        stats.rem_input_tokens = adder.rem_input_tokens
        stats.rem_chunk_tokens = adder.rem_chunk_tokens

    def _prepare_extend(self, reqs: list[Request], continuation: Request | None) -> None:
        """Allocate rows and slots, assign handles to newcomers, commit the extend lengths."""
        for req in reqs:
            if req is not continuation and not req.retracted_stain:
                req.cached_tokens = len(req.prefix_indices)
            req.is_retracted = False
            req.preempted = False
        self.kv.alloc_for_extend(reqs)
        self._introduced = set()
        for req in reqs:
            if req.host_backup_len:
                self._restore(req)
            if req.handle < 0:
                req.handle = self._next_handle
                self._next_handle += 1
                self.by_handle[req.handle] = req
                self._introduced.add(req.handle)
            req.kv_committed_len = req.extend_range[1]

    def _restore(self, req: Request) -> None:
        """Copy the host backup into the first slots of the fresh extend; compute only the rest."""
        n = req.host_backup_len
        self._restores.append(KvTransfer(req.handle, self.kv.row(req)[:n].copy()))
        del self.offloaded[req.handle]
        self.by_handle[req.handle] = req
        self.host_used -= n
        req.host_backup_len = 0
        req.extend_range = (n, req.extend_range[1])

    def _mix_with_running(self, batch: ScheduledBatch, stats: StepStats) -> None:
        """Mixed chunk (§4.4): decode the running batch inside the prefill step, no memory check."""
        if self.running.filter_finished():
            self.batch_is_full = False
        if not len(self.running):
            return
        batch.kind = StepKind.MIXED
        batch.decode_reqs = list(self.running.reqs)
        self._alloc_decode()
        stats.kind = StepKind.MIXED
        stats.decode_bs = len(batch.decode_reqs)
        self.running = RunningBatch()

    # --- decode (§6) ----------------------------------------------------------------------------

    def _update_running_batch(self, stats: StepStats) -> ScheduledBatch | None:
        if self.running.filter_finished():
            self.batch_is_full = False
        if not len(self.running):
            self.batch_is_full = False
            return None
        before = len(self.running)
        kv_full = not self.kv.check_decode_mem(self.running.seq_lens)
        test_retract = self.config.test_retract and self.forward_ct % self.config.test_retract_interval == 0
        if kv_full or test_retract:
            stats.kv_full = kv_full
            self._retract(stats)
        else:
            self.ratio.decay_step()
        if len(self.running) < before:
            self.batch_is_full = False
        if not len(self.running):
            return None
        stats.kind = StepKind.DECODE
        stats.decode_bs = len(self.running)
        batch = ScheduledBatch(StepKind.DECODE, decode_reqs=list(self.running.reqs))
        self._alloc_decode()
        return batch

    def _alloc_decode(self) -> None:
        self._decode_slots = self.kv.alloc_for_decode(self.running.rows, self.running.seq_lens)
        self._decode_handles = self.running.handles
        self.running.seq_lens += 1

    def _retraction_order(self) -> list[int]:
        """Indices, most worth keeping first; the loop retracts from the end (§6.3)."""
        reqs = self.running.reqs
        sign = self.priority_sign

        def key(i: int) -> tuple[int, ...]:
            r = reqs[i]
            length_key = (len(r.output_ids), -len(r.origin_input_ids))
            group_key = (1 if r.params.group else 0,)  # parallel-sample groups are kept first
            if self.config.retraction_policy == "priority":
                return (*group_key, _prio(r) * (-sign), *length_key)
            return (*group_key, *length_key)

        return sorted(range(len(reqs)), key=key, reverse=True)

    def _retract(self, stats: StepStats) -> None:
        reqs = self.running.reqs
        order = self._retraction_order()
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
            if self._release_for_requeue(victim, remaining=len(order)):
                retracted.append(victim)
        if len(order) == 1 and not self.kv.check_decode_mem(self.running.seq_lens[order]):
            last = reqs[order.pop()]
            self.kv.release_req(last, 0, self.config.retract_decode_steps)
            self._finish(last, FinishReason.abort(OOM_LAST_REQUEST, AbortCode.INTERNAL))
        self.running.keep(order)
        self.ratio.current = self.ratio.estimate_after_retract(
            self.running.reqs, self.config.retract_decode_steps
        )
        for req in retracted:
            self.num_retracted_total += 1
            self._add_to_queue_or_abort(req)
        stats.retracted = [r.rid for r in retracted]
        stats.retracted_input_tokens = sum(len(r.origin_input_ids) for r in retracted)
        stats.retracted_output_tokens = sum(len(r.output_ids) for r in retracted)
        stats.retract_tokens_gained = self.kv.available_size() - available_before

    def _abort_group(self, victim: Request, order: list[int]) -> list[int]:
        """A parallel-sample group is never partially retracted: under pressure it is aborted whole."""
        reqs = self.running.reqs
        members = [i for i in order if reqs[i].params.group == victim.params.group]
        for req in [victim, *(reqs[i] for i in members)]:
            self.kv.release_aborted(req)
            self._finish(
                req, FinishReason.abort("KV cache pool is full: the sample group was aborted together.")
            )
        return [i for i in order if i not in set(members)]

    def _release_for_requeue(self, req: Request, remaining: int) -> bool:
        """Release without inserting into the tree and reset for a later re-prefill (§6.4).

        With a host backup pool the KV is offloaded first and the worker keeps the handle; when the
        pool cannot hold it the request is aborted instead. Returns whether it is to be re-queued.
        """
        backed_up = self._backup(req)
        self.kv.release_req(req, remaining, self.config.retract_decode_steps)
        if backed_up is False:
            self._finish(req, FinishReason.abort(HOST_POOL_FULL.format(n=req.kv_committed_len)))
            return False
        if backed_up:
            del self.by_handle[req.handle]
            self.offloaded[req.handle] = req
        elif req.handle >= 0:
            self._release_handle(req)
        req.retraction_count += 1
        req.prefix_indices = np.zeros(0, dtype=np.int64)
        req.last_node = None
        req.cache_protected_len = 0
        req.extend_range = (0, 0)
        req.inflight_middle_chunks = 0
        req.is_retracted = True
        req.retracted_stain = True
        req.kv_committed_len = 0
        return True

    def _backup(self, req: Request) -> bool | None:
        """Offload the request's committed KV to the host pool: None when there is no host pool,
        False when it has no room."""
        if not self.host_capacity:
            return None
        n = req.kv_committed_len
        if self.host_used + n > self.host_capacity:
            return False
        self._offloads.append(KvTransfer(req.handle, self.kv.row(req)[:n].copy()))
        self.host_used += n
        req.host_backup_len = n
        return True

    def _add_to_queue_or_abort(self, req: Request) -> None:
        try:
            self._add_to_queue(req)
        except QueueFull:
            self._finish(req, FinishReason.abort(QUEUE_FULL))

    # --- the plan ---------------------------------------------------------------------------------

    def _build_plan(self, batch: ScheduledBatch | None, stats: StepStats) -> StepPlan:
        releases = np.asarray(self._releases, dtype=np.int64)
        # A remap queued for a request released since (retracted, preempted, aborted) is moot: the
        # worker drops the sequence before it would apply the remap.
        released = set(self._releases)
        remaps = tuple(r for r in self._remaps if r.handle not in released)
        offloads, restores = tuple(self._offloads), tuple(self._restores)
        self._releases, self._remaps, self._offloads, self._restores = [], [], [], []
        if batch is None:
            return StepPlan(
                self.step_id, StepKind.DECODE, releases=releases, remaps=remaps, offloads=offloads
            )
        extends, new_seqs = self._extend_work(batch.extend_reqs)
        decodes = DecodeWork()
        if batch.decode_reqs:
            decodes = DecodeWork(handles=self._decode_handles.copy(), slots=self._decode_slots)
        return StepPlan(
            self.step_id,
            batch.kind,
            releases=releases,
            remaps=remaps,
            offloads=offloads,
            restores=restores,
            new_seqs=new_seqs,
            extends=extends,
            decodes=decodes,
        )

    def _extend_work(self, reqs: list[Request]) -> tuple[ExtendWork, tuple[NewSeq, ...]]:
        if not reqs:
            return ExtendWork(), ()
        new_seqs = []
        tokens: list[int] = []
        slots: list[np.ndarray] = []
        for req in reqs:
            start, end = req.extend_range
            if req.handle in self._introduced:
                new_seqs.append(self._new_seq(req, start))
            tokens.extend(req.fill_ids[start:end])
            slots.append(self.kv.row(req)[start:end])
        return (
            ExtendWork(
                handles=np.fromiter((r.handle for r in reqs), dtype=np.int64, count=len(reqs)),
                starts=np.fromiter((r.extend_range[0] for r in reqs), dtype=np.int32, count=len(reqs)),
                lens=np.fromiter(
                    (r.extend_range[1] - r.extend_range[0] for r in reqs), dtype=np.int32, count=len(reqs)
                ),
                sample=np.fromiter((r is not self.chunked_req for r in reqs), dtype=bool, count=len(reqs)),
                token_ids=np.asarray(tokens, dtype=np.int32),
                slots=np.concatenate(slots).astype(np.int64),
            ),
            tuple(new_seqs),
        )

    def _new_seq(self, req: Request, start: int) -> NewSeq:
        history = np.zeros(0, dtype=np.int32)
        if req.params.sampler.uses_penalties:
            history = np.asarray(req.fill_ids[:start], dtype=np.int32)
        return NewSeq(
            req.handle,
            req.params.sampler,
            prefix_slots=self.kv.row(req)[:start].copy(),
            history_ids=history,
            request_id=req.rid,
            prompt_len=len(req.origin_input_ids),
            sim_output_len=req.params.sim_output_len,
        )

    # --- results (process_batch_result) ---------------------------------------------------------

    def apply_result(self, result: StepResult) -> None:
        """Append sampled tokens, run finish checks, cache or free KV of finished requests."""
        batch = self.last_batch
        if batch is None:
            return
        sampled = dict(zip(result.handles.tolist(), result.token_ids.tolist(), strict=True))
        for req in batch.extend_reqs:
            self._apply_extend(req, sampled)
        for req in batch.decode_reqs:
            if req.finished:
                continue
            req.kv_committed_len += 1
            self._append_token(req, sampled[req.handle])

    def _apply_extend(self, req: Request, sampled: dict[int, int]) -> None:
        if req.finished:
            return
        if req.inflight_middle_chunks > 0:
            req.inflight_middle_chunks -= 1
            if req is self.chunked_req:
                return  # a middle chunk: nothing was sampled
        if req.max_new_tokens == 0 and not req.output_ids:
            self.kv.cache_finished_req(req, insert=True)
            self._finish(req, FinishReason.length("max_new_tokens"))
            return
        self._append_token(req, sampled[req.handle])
        if not req.finished:
            self._push_remap(self.kv.cache_unfinished_req(req))

    def _append_token(self, req: Request, token: int) -> None:
        req.append_output(token)
        reason, visible = self._check_finished(req, token)
        if reason is None:
            self._updates.append(RequestUpdate(req.rid, (token,)))
            return
        self.kv.cache_finished_req(req, insert=True)
        self._finish(req, reason, (token,) if visible else ())

    def _check_finished(self, req: Request, token: int) -> tuple[FinishReason | None, bool]:
        """SGLang's order: the length limit first, then a matched stop or EOS token (not streamed)."""
        if len(req.output_ids) >= req.max_new_tokens:
            matched = token in req.params.stop_token_ids or (
                not req.params.ignore_eos and token in self.limits.eos_token_ids
            )
            return FinishReason.length("max_new_tokens"), not matched
        if token in req.params.stop_token_ids:
            return FinishReason.stop(f"stop token {token}"), False
        if not req.params.ignore_eos and token in self.limits.eos_token_ids:
            return FinishReason.stop("eos"), False
        return None, True

    # --- idle and books ---------------------------------------------------------------------------

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


def _prio(req: Request) -> int:
    return req.priority if req.priority is not None else 0
