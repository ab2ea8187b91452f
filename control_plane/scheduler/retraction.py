"""Decode and retraction (docs/scheduler.md#retraction): the memory check, retraction order, the OOM abort of
the
last request, sample groups aborted whole, and the host backup pool (docs/scheduler.md#host-backup-pool)."""

from __future__ import annotations

import numpy as np

from control_plane.request import AbortCode, FinishReason, Request
from control_plane.scheduler.batch import ScheduledBatch
from control_plane.scheduler.intake import Intake
from control_plane.scheduler.priority import urgency
from control_plane.scheduler.state import StepStats
from protos.worker import KvTransfer, StepKind

HOST_POOL_FULL = (
    "KV cache pool is full and the host backup pool has no room for this request's {n} tokens: "
    "aborted instead of retracted."
)
GROUP_ABORTED = "KV cache pool is full: the sample group was aborted together."
OOM_LAST_REQUEST = (
    "Out of memory even after retracting all other requests in the decode batch. Aborting the last request."
)


class Retraction(Intake):
    """The decode step and what gives way when KV runs out (docs/scheduler.md#retraction)."""

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
        batch = ScheduledBatch(StepKind.DECODE)
        batch.decode_from(self.running)
        self._alloc_decode()
        return batch

    def _alloc_decode(self) -> None:
        """A slot for every running request's next position: plan-time work on the columns only."""
        rows = self.running.rows
        self._decode_slots = self.kv.alloc_for_decode(rows, self.running.seq_lens)
        self._decode_handles = self.kv.columns.handle[rows]
        self._seq_slots += len(rows)

    def _retraction_order(self) -> list[int]:
        """Indices, most worth keeping first; the loop retracts from the end
        (docs/scheduler.md#retraction)."""
        reqs = self.running.reqs
        sign = self.priority_sign

        def key(i: int) -> tuple[int, ...]:
            r = reqs[i]
            length_key = (r.num_outputs, -len(r.origin_input_ids))
            group_key = (1 if r.params.group else 0,)  # parallel-sample groups are kept first
            if self.config.retraction_policy == "priority":
                return (*group_key, -urgency(r, sign), *length_key)
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
            reason = FinishReason.abort(OOM_LAST_REQUEST, AbortCode.INTERNAL)
            self._finish(last, reason)
            stats.oom_aborted.append(last.rid)
            if last.params.group:
                self._abort_group_elsewhere(last.params.group, reason)
        self.running.keep(order)
        self.ratio.current = self.ratio.estimate_after_retract(
            self.running.reqs, self.config.retract_decode_steps
        )
        for req in retracted:
            self.num_retracted_total += 1
            self._add_to_queue_or_abort(req)
        stats.retracted = [r.rid for r in retracted]
        stats.retracted_input_tokens = sum(len(r.origin_input_ids) for r in retracted)
        stats.retracted_output_tokens = sum(r.num_outputs for r in retracted)
        stats.retract_tokens_gained = self.kv.available_size() - available_before

    def _abort_group(self, victim: Request, order: list[int]) -> list[int]:
        """A parallel-sample group is never partially retracted: under pressure it is aborted whole,
        members still waiting or mid-chunk included."""
        reason = FinishReason.abort(GROUP_ABORTED)
        reqs = self.running.reqs
        members = [i for i in order if reqs[i].params.group == victim.params.group]
        for req in [victim, *(reqs[i] for i in members)]:
            self.kv.release_aborted(req)
            self._finish(req, reason)
        self._abort_group_elsewhere(victim.params.group, reason)
        return [i for i in order if i not in set(members)]

    def _abort_group_elsewhere(self, group: str, reason: FinishReason) -> None:
        """The group's members still waiting or mid-chunk go with the rest of it."""
        for req in [r for r in self.requests.values() if r.params.group == group]:
            if not req.finished and (req in self.waiting or req is self.chunked_req):
                self.abort(req.rid, reason)

    def _release_for_requeue(self, req: Request, remaining: int) -> bool:
        """Release without inserting into the tree and reset for a later re-prefill
        (docs/scheduler.md#retraction).

        With a host backup pool the KV is offloaded first and the worker keeps the handle; when the
        pool cannot hold it the request is aborted instead. Returns whether it is to be re-queued.
        """
        backed_up = self._backup(req)
        self.kv.release_req(req, remaining, self.config.retract_decode_steps)
        if backed_up is False:
            self._finish(req, FinishReason.abort(HOST_POOL_FULL.format(n=req.kv_committed_len)))
            return False
        if backed_up:
            self._forget_sequence(req)
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
        req.kv_committed_len = req.kv_allocated_len = 0
        return True

    def _backup(self, req: Request) -> bool | None:
        """Offload the request's committed KV to the host pool: None when there is no host pool,
        False when it has no room. Only committed positions: a decode in flight for it wrote one
        more, whose token is discarded; the re-prefill after the restore recomputes it."""
        if not self.host_capacity:
            return None
        n = req.kv_committed_len
        if self.host_used + n > self.host_capacity:
            return False
        self._offloads.append(KvTransfer(req.handle, self.kv.row(req)[:n].copy()))
        self.host_used += n
        req.host_backup_len = n
        return True
