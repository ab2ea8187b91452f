"""Building a prefill batch (docs/scheduler.md#admission-loop, #chunked-prefill): the chunked request, the
admission loop under
the adder's budgets, batch_is_full, and mixing the running batch into a prefill step
(docs/scheduler.md#mixed-chunk)."""

from __future__ import annotations

import numpy as np

from control_plane.request import AbortCode, FinishReason, Request
from control_plane.scheduler.adder import AddReqResult, PrefillAdder
from control_plane.scheduler.batch import RunningBatch, ScheduledBatch
from control_plane.scheduler.preemption import Preemption
from control_plane.scheduler.state import StepStats
from protos.worker import KvTransfer, StepKind

OOM_CHUNK = "Out of memory: no room for the next chunk of this prompt and nothing running to free any."


class Admission(Preemption):
    """The prefill batch: who is admitted this step and with which chunk
    (docs/scheduler.md#prefill-adder-budgets, #chunked-prefill)."""

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

    def _merge_last_batch(self) -> None:
        """docs/scheduler.md#step-loop step 4: the last extend batch's requests join the running
        batch, unless finished or still mid-chunk. Under overlap their prefill may still be in flight:
        they are decoded before their first token is known (docs/scheduler.md#overlap (c)). A request
        with max_new_tokens 0
        only needs its prefill
        (SGLang never decodes a prefill-only batch): it ends when that result is applied."""
        last = self.last_batch
        if last is None or not last.is_extend:
            return
        extended = [
            r
            for r in last.extend_reqs
            if not r.finished and r is not self.chunked_req and r.max_new_tokens > 0
        ]
        decoded = self.kv.columns.serial[last.decode_rows] == last.decode_serials
        survivors = len(extended) + int(np.count_nonzero(decoded))
        if survivors != len(last.extend_reqs) + len(last.decode_rows):
            self.batch_is_full = False
        if extended:
            self.running.merge(extended)
        if decoded.any():
            self.running.append(
                last.decode_reqs[decoded], last.decode_rows[decoded], last.decode_serials[decoded]
            )

    def _parked_chunk(self, req: Request) -> None:
        """The chunked request got no chunk: not even a page is free or evictable. Running requests
        will finish or be retracted and free memory; with none, nothing ever will, so it ends."""
        if len(self.running):
            return
        self.chunked_req = None
        self.kv.release_aborted(req)
        self._finish(req, FinishReason.abort(OOM_CHUNK, AbortCode.INTERNAL))

    def _allocatable(self, running_bs: int) -> int:
        """Requests that may still join: free rows, and room under the running cap for a running
        batch of `running_bs` (docs/scheduler.md#admission-loop step 5's get_num_allocatable_reqs)."""
        return min(self.max_running_requests - running_bs, self.kv.free_rows())

    def _get_new_batch_prefill(self, stats: StepStats) -> ScheduledBatch | None:
        if self.preemption:
            self.batch_is_full = False
        if (self.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        if self._allocatable(len(self.running)) <= 0 and self.chunked_req is None and not self.preemption:
            self.batch_is_full = True
            return None
        running = self.running.reqs
        self.policy.order(self.waiting, running)
        mixed = self.config.enable_mixed_chunk and len(self.running) > 0
        running_bs = len(self.running)
        adder = PrefillAdder(
            self.kv,
            self.adder_limits,
            running,
            self.ratio.current,
            mixed_decode_tokens=running_bs if mixed else 0,
            remaining=self.running.remaining_new_tokens(),
        )
        chunked_before = self.chunked_req
        if self.chunked_req is not None:
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
            if self.chunked_req is not None and self.chunked_req not in adder.can_run_list:
                self._parked_chunk(self.chunked_req)
        preempted = self._admit_waiting(adder, running_bs)
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
        if self.chunked_req is not None and self.chunked_req in adder.can_run_list:
            self.chunked_req.inflight_middle_chunks += 1
        batch = ScheduledBatch(StepKind.PREFILL, extend_reqs=list(adder.can_run_list))
        batch.chunked_req = self.chunked_req
        self._prepare_extend(batch, chunked_before)
        if mixed:
            self._mix_with_running(batch, stats)
        return batch

    def _admit_waiting(self, adder: PrefillAdder, running_bs: int) -> list[Request]:
        """The admission loop (docs/scheduler.md#admission-loop step 9). Returns requests preempted to
        make room.

        The slot limit uses the running batch as it was when the pass began (SGLang computes
        running_bs once, `scheduler.py:_get_new_batch_prefill_raw`): requests preempted in this pass
        free their rows, but not their places under the running cap, until the next pass.
        """
        preempted: list[Request] = []
        for req in self.waiting:
            if len(adder.can_run_list) >= self._allocatable(running_bs):
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

    def _prepare_extend(self, batch: ScheduledBatch, continuation: Request | None) -> None:
        """Allocate rows and slots, assign handles to newcomers, commit the extend lengths, and note
        in the batch each request's row tenancy and whether a token is sampled after its extend."""
        reqs = batch.extend_reqs
        for req in reqs:
            if req is not continuation and not req.retracted_stain:
                req.cached_tokens = len(req.prefix_indices)
            req.is_retracted = False
            req.preempted = False
        self.kv.alloc_for_extend(reqs)
        self._introduced = set()
        columns = self.kv.columns
        for req in reqs:
            start, end = req.extend_range
            # A live sequence's table holds exactly the positions before its extend.
            held = start if req.handle in self.by_handle else 0
            if req.host_backup_len:
                self._restore(req)
            if req.handle < 0:
                req.handle = self._next_handle
                self._next_handle += 1
                self.by_handle[req.handle] = req
                self._introduced.add(req.handle)
            columns.handle[req.req_pool_idx] = req.handle
            req.kv_committed_len = end
            self._seq_slots += end - held
            batch.extend_serials.append(int(columns.serial[req.req_pool_idx]))
            batch.extend_sampled.append(req is not self.chunked_req)

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
        """Mixed chunk (docs/scheduler.md#mixed-chunk): decode the running batch inside the prefill step.

        SGLang mixes without a memory check: admission pre-charged one token per running request,
        but with pages a decode at a page boundary takes a whole page, and the allocation could fail
        (SGLang raises there). When the decode does not fit, this step runs the prefill alone; the
        running batch decodes next step, where the decode memory check and retraction apply.
        """
        if self.running.filter_finished():
            self.batch_is_full = False
        if not len(self.running) or not self.kv.check_decode_mem(self.running.seq_lens):
            return
        batch.kind = StepKind.MIXED
        batch.decode_from(self.running)
        self._alloc_decode()
        stats.kind = StepKind.MIXED
        stats.decode_bs = len(batch.decode_rows)
        self.running = RunningBatch(self.kv.columns)
