"""Building a prefill batch (docs/scheduler.md#admission-loop, #chunked-prefill): the chunked request, the
admission loop under the adder's budgets, batch_is_full, and mixing the running batch into a prefill
step (docs/scheduler.md#mixed-chunk)."""

from __future__ import annotations

from control_plane.config import SchedulerConfig
from control_plane.request import AbortCode, FinishReason, Request
from control_plane.scheduler.adder import AdderLimits, AddReqResult, PrefillAdder
from control_plane.scheduler.batch import RunningBatch, ScheduledBatch
from control_plane.scheduler.books import SequenceBooks
from control_plane.scheduler.chunk import ChunkInProgress
from control_plane.scheduler.decode import Decode
from control_plane.scheduler.exits import Exits
from control_plane.scheduler.fair_preemption import FairPreemption
from control_plane.scheduler.intake import Intake
from control_plane.scheduler.isolation import NO_TENANTS, StepBudget, StepIsolation
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.policy import Policy
from control_plane.scheduler.preemption import Preemption
from control_plane.scheduler.ratio import NewTokenRatioTracker
from control_plane.scheduler.records import StepStats
from protos.worker import StepKind

OOM_CHUNK = "Out of memory: no room for the next chunk of this prompt and nothing running to free any."


class Admission:
    """The prefill batch: who is admitted this step and with which chunk (SGLang's
    _get_new_batch_prefill_raw; docs/scheduler.md#prefill-adder-budgets, #chunked-prefill)."""

    def __init__(
        self,
        config: SchedulerConfig,
        adder_limits: AdderLimits,
        max_running_requests: int,
        kv: KvManager,
        policy: Policy,
        ratio: NewTokenRatioTracker,
        running: RunningBatch,
        intake: Intake,
        books: SequenceBooks,
        exits: Exits,
        chunk: ChunkInProgress,
        preemption: Preemption,
        decode: Decode,
        fair_preemption: FairPreemption | None = None,
        isolation: StepIsolation | None = None,
    ) -> None:
        self.config = config
        self.adder_limits = adder_limits
        self.max_running_requests = max_running_requests
        self.kv = kv
        self.policy = policy
        self.ratio = ratio
        self.running = running
        self.intake = intake
        self.books = books
        self.exits = exits
        self.chunk = chunk
        self.preemption = preemption
        self.decode = decode
        self.try_preemption = config.enable_priority_scheduling and not config.disable_priority_preemption
        # Fairness preemption (docs/scheduler.md#fairness-preemption): None unless --fairness-preempt-bound.
        self.fair_preemption = fair_preemption
        self.may_preempt = self.try_preemption or (fair_preemption is not None and fair_preemption.bound > 0)
        # Step isolation (docs/scheduler.md#fairness-isolation): None unless --fairness-isolation-tokens.
        self.isolation = isolation
        # Isolation's decode turn: the latest prefill step held the heavy tenants' prompts alone.
        self.heavy_only_last = False

    # --- the chunked request between steps (docs/scheduler.md#step-loop steps 1 and 3) ----------------

    def process_pending_chunked_abort(self) -> None:
        taken = self.chunk.take_pending_abort()
        if taken is not None:
            self.exits.discard(*taken)

    def stash_chunked_req(self) -> None:
        """The chunk computed last step goes into the tree (docs/scheduler.md#caching-requests)."""
        req = self.chunk.req
        if req is not None and req.extend_range[1] > len(req.prefix_indices):
            self.books.remap(self.kv.cache_unfinished_req(req, chunked=True))

    # --- the prefill batch -----------------------------------------------------------------------------

    def get_new_batch_prefill(self, stats: StepStats) -> ScheduledBatch | None:
        running, chunk = self.running, self.chunk
        heavy_only_last, self.heavy_only_last = self.heavy_only_last, False
        shares = None
        if self.isolation is not None and (self.intake.waiting or chunk.req is not None):
            shares = self.isolation.shares(running.reqs, chunk.req)
        # Heavy tenants give way to the others (docs/scheduler.md#fairness-isolation): as with
        # preemption, a full batch is tried again every pass while there are any.
        may_preempt = self.may_preempt or (shares is not None and bool(shares.heavy))
        if may_preempt:
            running.clear_full()
        if (running.batch_is_full or not self.intake.waiting) and chunk.req is None:
            return None
        if self._allocatable(len(running)) <= 0 and chunk.req is None and not may_preempt:
            running.mark_full()
            return None
        running_reqs = running.reqs
        self.intake.order(self.policy, running_reqs)
        budget = None
        if self.isolation is not None and shares is not None:
            budget = self.isolation.begin(self.intake.waiting, shares, heavy_only_last)
        mixed = self.config.enable_mixed_chunk and len(running) > 0
        running_bs = len(running)
        adder = PrefillAdder(
            self.kv,
            self.adder_limits,
            running_reqs,
            self.ratio.current,
            mixed_decode_tokens=running_bs if mixed else 0,
            remaining=running.remaining_new_tokens(),
        )
        continuation = chunk.req
        if continuation is not None and not self._sits_out(continuation, budget, adder):
            if budget is None:
                chunk.advance(adder.add_chunked_req(continuation))
            else:
                add_chunk = adder.add_chunked_req
                chunk.advance(budget.admit(adder, continuation, lambda: add_chunk(continuation), joins=False))
            if chunk.req is not None and chunk.req not in adder.can_run_list:
                self._parked_chunk(chunk.req)
        if budget is not None:
            budget.chunk_open = chunk.req is not None
        preempted = self._admit_waiting(adder, running_bs, budget)
        if adder.can_run_list:
            self.intake.remove_admitted({id(r) for r in adder.can_run_list})
        # Back to the queue even when nothing was admitted: preemption checks only that the victims'
        # reservations cover the newcomer (need <= 0), which can still be refused by add_one_req (it
        # wants input + max_new + page < rem_total). SGLang re-queues them only after a pass that
        # admitted something, and otherwise loses them: released, in no queue, never finished.
        for req in preempted:
            self.intake.requeue(req)
        if not adder.can_run_list:
            return None
        self.heavy_only_last = budget is not None and all(budget.is_heavy(r) for r in adder.can_run_list)
        self._fill_stats(stats, adder, running_bs)
        if adder.new_chunked_req is not None:
            chunk.start(adder.new_chunked_req)
        if chunk.req is not None and chunk.req in adder.can_run_list:
            chunk.req.inflight_middle_chunks += 1
        batch = ScheduledBatch(StepKind.PREFILL, stats.step_id, extend_reqs=list(adder.can_run_list))
        self._prepare_for_extend(batch, continuation)
        if mixed:
            self._mix_with_running(batch, stats)
        return batch

    def _allocatable(self, running_bs: int) -> int:
        """Requests that may still join: free rows, and room under the running cap for a running
        batch of `running_bs` (docs/scheduler.md#admission-loop step 5's get_num_allocatable_reqs)."""
        return min(self.max_running_requests - running_bs, self.kv.free_rows())

    def _sits_out(self, continuation: Request, budget: StepBudget | None, adder: PrefillAdder) -> bool:
        """Isolation: a heavy tenant's chunk waits while a light tenant's request heads the queue
        and something runs (docs/scheduler.md#fairness-isolation)."""
        if budget is None or not len(self.running) or adder.rem_chunk_tokens is None:
            return False
        waiting = self.intake.waiting
        return budget.sits_out(continuation, waiting[0] if waiting else None, adder.rem_chunk_tokens)

    def _parked_chunk(self, req: Request) -> None:
        """The chunked request got no chunk: not even a page is free or evictable. Running requests
        will finish or be retracted and free memory; with none, nothing ever will, so it ends."""
        if len(self.running):
            return
        self.chunk.drop()
        self.exits.discard(req, FinishReason.abort(OOM_CHUNK, AbortCode.INTERNAL))

    def _admit_waiting(
        self, adder: PrefillAdder, running_bs: int, budget: StepBudget | None = None
    ) -> list[Request]:
        """The admission loop (docs/scheduler.md#admission-loop step 9). Returns requests preempted to
        make room.

        The slot limit uses the running batch as it was when the pass began (SGLang computes
        running_bs once, `scheduler.py:_get_new_batch_prefill_raw`): requests preempted in this pass
        free their rows, but not their places under the running cap, until the next pass.
        """
        running = self.running
        preempted: list[Request] = []
        for req in self.intake.waiting:
            if budget is not None and not budget.allows(req):
                break
            if len(adder.can_run_list) >= self._allocatable(running_bs):
                running.mark_full()
            heavy = budget.givers(req) if budget is not None else NO_TENANTS
            if running.batch_is_full and not self._preempt_for(req, adder, preempted, heavy):
                break
            self.kv.init_next_round_input(req)
            if budget is not None and budget.chunk_open and adder.would_chunk(req):
                break  # one request mid-chunk at a time
            ignore_eos_path = req.params.ignore_eos and self.kv.disabled
            result = self._add(adder, req, ignore_eos_path, budget)
            if result is AddReqResult.NO_TOKEN and self._fair_room(req, adder, preempted, ignore_eos_path):
                # The release may have evicted the prefix it matched: match again before retrying.
                self.kv.init_next_round_input(req)
                result = self._add(adder, req, ignore_eos_path, budget)
            if result is not AddReqResult.CONTINUE:
                if result is AddReqResult.NO_TOKEN:
                    running.mark_full()
                break
        return preempted

    @staticmethod
    def _add(
        adder: PrefillAdder, req: Request, ignore_eos_path: bool, budget: StepBudget | None
    ) -> AddReqResult:
        if budget is None:
            return adder.add_one_req(req, ignore_eos_path)
        return budget.admit(adder, req, lambda: adder.add_one_req(req, ignore_eos_path))

    def _preempt_for(
        self, req: Request, adder: PrefillAdder, preempted: list[Request], heavy: frozenset[str]
    ) -> bool:
        """The running batch is full: priority preemption, else fairness preemption, may make room."""
        if self.try_preemption and self.preemption.preempt_for(req, adder, preempted):
            return True
        fair = self.fair_preemption
        return fair is not None and fair.preempt_for(req, adder, preempted, heavy)

    def _fair_room(
        self, req: Request, adder: PrefillAdder, preempted: list[Request], ignore_eos_path: bool
    ) -> bool:
        """Its tokens did not fit (refused before anything was booked for it): fairness preemption
        may make room for it, then it is tried once more. Not isolation's give-way (one heavy request
        for a slot): the running cap keeps heavy tenants off the pool instead."""
        fair = self.fair_preemption
        if fair is None or ignore_eos_path or req in adder.can_run_list:
            return False
        return fair.preempt_for(req, adder, preempted)

    def _fill_stats(self, stats: StepStats, adder: PrefillAdder, running_bs: int) -> None:
        stats.kind = StepKind.PREFILL
        stats.new_seqs = len(adder.can_run_list)
        stats.new_tokens = adder.log_input_tokens
        stats.cached_tokens = adder.log_hit_tokens
        stats.cache_hit_rate = adder.cache_hit_rate
        stats.running_at_admission = running_bs
        stats.rem_total_tokens = adder.rem_total_tokens
        stats.rem_input_tokens = adder.rem_input_tokens
        stats.rem_chunk_tokens = adder.rem_chunk_tokens

    def _prepare_for_extend(self, batch: ScheduledBatch, continuation: Request | None) -> None:
        """Allocate rows and slots, assign handles to newcomers, commit the extend lengths, and note
        in the batch each request's row tenancy and whether a token is sampled after its extend."""
        reqs = batch.extend_reqs
        for req in reqs:
            if req is not continuation and not req.retracted_stain:
                req.cached_tokens = len(req.prefix_indices)
            req.is_retracted = False
            req.preempted = False
        self.kv.alloc_for_extend(reqs)
        columns = self.kv.columns
        books = self.books
        for req in reqs:
            start, end = req.extend_range
            # A live sequence's table holds exactly the positions before its extend.
            held = start if books.holds(req) else 0
            if req.host_backup_len:
                # The host backup fills the first slots of the fresh extend; compute only the rest.
                restored = books.restore(req, self.kv.row(req))
                req.extend_range = (restored, end)
            introduced = books.introduce(req)
            columns.set_handle(req)
            req.kv_committed_len = end
            books.grow(end - held)
            batch.note_extend(
                int(columns.serial[req.req_pool_idx]),
                req is not self.chunk.req,
                req.handle if introduced else None,
            )

    def _mix_with_running(self, batch: ScheduledBatch, stats: StepStats) -> None:
        """Mixed chunk (docs/scheduler.md#mixed-chunk): decode the running batch inside the prefill step.

        SGLang mixes without a memory check: admission pre-charged one token per running request,
        but with pages a decode at a page boundary takes a whole page, and the allocation could fail
        (SGLang raises there). When the decode does not fit, this step runs the prefill alone; the
        running batch decodes next step, where the decode memory check and retraction apply.
        """
        running = self.running
        running.filter_finished()
        if not len(running):
            return
        # SGLang's mix_with_running refreshes each running request's fill (what a later preemption
        # reckons from, docs/scheduler.md#priority-preemption), whether or not the decode then fits here.
        for req in running.reqs:
            req.matched_fill_len = req.seqlen
        if not self.kv.check_decode_mem(running.seq_lens):
            return
        self.decode.prepare_for_decode(batch)
        stats.kind = StepKind.MIXED
        stats.decode_bs = len(batch.decode_rows)
        running.empty()
