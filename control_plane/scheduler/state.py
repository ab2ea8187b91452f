"""The scheduler's state, and what every part of it needs: the request registry, finishing a
request, releasing its handle, the books of what the worker holds, and the updates the engine
publishes.

The Scheduler is assembled from one class per seam of docs/scheduler.md, each building on the ones before it:
state -> intake (docs/scheduler.md#intake) -> retraction (docs/scheduler.md#retraction) -> preemption
(docs/scheduler.md#priority-preemption) -> admission (docs/scheduler.md#prefill-adder-budgets,
#chunked-prefill) -> planning (the wire plan) -> results (process_batch_result) -> scheduler
(docs/scheduler.md#step-loop, the step).

Requests that hold a request row keep their per-step state in `kv.columns` (the rule is in
control_plane/scheduler/columns.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from control_plane.config import SchedulerConfig
from control_plane.request import FinishReason, Request
from control_plane.scheduler.adder import AdderLimits
from control_plane.scheduler.batch import RunningBatch, ScheduledBatch
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.policy import make_policy
from control_plane.scheduler.priority import priority_sign
from control_plane.scheduler.ratio import NewTokenRatioTracker
from control_plane.scheduler.sizing import resolve_max_running_requests
from protos.worker import KvTransfer, SlotRemap, StepKind, WorkerLimits

MAX_INT = 2**63 - 1


class QueueFull(Exception):
    """The waiting queue is at --max-queued-requests and the newcomer may not displace anyone."""


class RequestRejected(Exception):
    """Refused at intake (e.g. a priority while priority scheduling is off)."""


def _no_uids() -> np.ndarray:
    return np.zeros(0, dtype=np.uint64)


def _no_tokens() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Streamed tokens, one entry each, in the order they were produced (a uid appears once per
    result that gave its request a token). A matched EOS / stop token is not streamed."""

    uids: np.ndarray = field(default_factory=_no_uids)  # uint64: the request's `uid`
    token_ids: np.ndarray = field(default_factory=_no_tokens)  # int32

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """A request ended (its last visible token, if any, is in the same or an earlier TokenBatch)."""

    rid: str
    uid: int
    reason: FinishReason
    # Prompt tokens that were served from the prefix cache.
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepUpdates:
    """What to publish since the last `take_updates`: consume `tokens` first, then `finished`
    (every token of a request precedes its finish)."""

    tokens: TokenBatch = field(default_factory=TokenBatch)
    finished: tuple[RequestFinished, ...] = ()

    @property
    def empty(self) -> bool:
        return not len(self.tokens) and not self.finished


@dataclass(slots=True)
class StepStats:
    """Per-step figures for the log lines (docs/scheduler.md#logs-and-metrics) and the recorder."""

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
    # Prefill cache-hit rate without re-processed retracted work (docs/scheduler.md#logs-and-metrics); 0 for a
    # decode step.
    cache_hit_rate: float = 0.0
    # Requests aborted because even alone they did not fit (docs/scheduler.md#retraction's OOM abort of the
    # last request).
    oom_aborted: list[str] = field(default_factory=list)


class SchedulerState:
    """State for one worker's pool and the operations every seam shares."""

    def __init__(self, config: SchedulerConfig, limits: WorkerLimits) -> None:
        self.config = config
        self.limits = limits
        self.page_size = config.page_size or limits.page_size
        self.capacity = limits.kv_capacity_tokens
        self.max_req_len = min(limits.max_context - 1, self.capacity - 1)
        # SGLang's max_req_len - 5, and with large pages also short of a page below the pool: a
        # longer prompt passes the length check but never the adder's gate (input + page < pool),
        # so it would wait forever; it is refused at intake instead.
        self.max_req_input_len = min(self.max_req_len - 5, self.capacity - self.page_size)
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
            low_priority_values_first=config.schedule_low_priority_values_first,
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
        self.priority_sign = priority_sign(config.schedule_low_priority_values_first)
        self._eos_ids = np.array(sorted(limits.eos_token_ids), dtype=np.int32)
        self.preemption = config.enable_priority_scheduling and not config.disable_priority_preemption
        self.waiting: list[Request] = []
        self.running = RunningBatch(self.kv.columns)
        self.chunked_req: Request | None = None
        # The batch most recently planned (docs/scheduler.md#step-loop step 4 merges it), and every planned
        # batch whose result is not applied yet, oldest first (overlap scheduling keeps more than one,
        # docs/scheduler.md#overlap).
        self.last_batch: ScheduledBatch | None = None
        self._in_flight: deque[ScheduledBatch] = deque()
        self.batch_is_full = False
        self.forward_ct = 0
        self.step_id = 0
        self.requests: dict[str, Request] = {}
        # Sequences the worker holds after the most recent plan (offloaded ones aside), and the sum
        # of their slot tables (= their kv_allocated_len): the books `books()` reports.
        self.by_handle: dict[int, Request] = {}
        self._seq_slots = 0
        self._clock = 0
        self._next_handle = 1
        self._pending_chunked_abort: FinishReason | None = None
        self._releases: list[int] = []
        # Host backup pool (docs/scheduler.md#host-backup-pool): retracted requests' KV waits there, under the
        # request's handle, until re-admission restores it into fresh slots.
        self.host_capacity = limits.host_pool_capacity_tokens
        self.host_used = 0
        self.offloaded: dict[int, Request] = {}
        self._offloads: list[KvTransfer] = []
        self._restores: list[KvTransfer] = []
        self._remaps: list[SlotRemap] = []
        # Streamed tokens (uids, ids) per applied result, and finishes, until `take_updates`.
        self._token_uids: list[np.ndarray] = []
        self._token_ids: list[np.ndarray] = []
        self._finished: list[RequestFinished] = []
        # Handles introduced by the extend being planned (they get a NewSeq in the plan).
        self._introduced: set[int] = set()
        self._decode_slots = np.zeros(0, dtype=np.int64)
        self._decode_handles = np.zeros(0, dtype=np.int64)
        self.last_stats: StepStats | None = None
        # Requests retracted so far (GetServerInfo).
        self.num_retracted_total = 0

    # --- the registry, finishes and releases -----------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

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

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """The request has ended; its KV must already be cached or freed (it holds no row)."""
        req.finish(reason)
        if req.handle >= 0:
            self._release_handle(req)
        self.requests.pop(req.rid, None)
        self._finished.append(RequestFinished(req.rid, req.uid, reason, req.cached_tokens))

    def _release_handle(self, req: Request) -> None:
        """The worker forgets this sequence in the next plan (and drops any host backup of it)."""
        self._releases.append(req.handle)
        self._forget_sequence(req)
        if self.offloaded.pop(req.handle, None) is not None:
            self.host_used -= req.host_backup_len
            req.host_backup_len = 0
        req.handle = -1

    def _forget_sequence(self, req: Request) -> None:
        """Out of the books: the worker will no longer hold this sequence's slot table on the device."""
        if self.by_handle.pop(req.handle, None) is not None:
            self._seq_slots -= req.kv_allocated_len

    def _stream(self, uids: np.ndarray, tokens: np.ndarray) -> None:
        if len(tokens):
            self._token_uids.append(uids)
            self._token_ids.append(tokens)

    def take_updates(self) -> StepUpdates:
        """Tokens and finishes since the last call (tokens first: see StepUpdates)."""
        tokens = TokenBatch()
        if self._token_ids:
            tokens = TokenBatch(_concat(self._token_uids), _concat(self._token_ids))
        updates = StepUpdates(tokens, tuple(self._finished))
        self._token_uids, self._token_ids, self._finished = [], [], []
        return updates

    def _push_remap(self, remap: SlotRemap | None) -> None:
        if remap is not None:
            self._remaps.append(remap)

    def _init_next_round_input(self, req: Request) -> None:
        if req.host_backup_len:
            # Its KV comes back from the host pool: no prefix match, no lock.
            req.prefix_indices, req.last_node, req.cache_protected_len = np.zeros(0, dtype=np.int64), None, 0
            return
        # A match never covers the last token: the prefill must produce logits
        # (docs/scheduler.md#prefill-adder-budgets, #invariants).
        self.kv.match_prefix(req, max(req.seqlen - 1, 0))
        req.cache_protected_len = len(req.prefix_indices)


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
