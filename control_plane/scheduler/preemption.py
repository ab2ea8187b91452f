"""Priority preemption on admission (docs/scheduler.md#priority-preemption)."""

from __future__ import annotations

from control_plane.request import Request
from control_plane.scheduler.adder import PrefillAdder
from control_plane.scheduler.batch import RunningBatch
from control_plane.scheduler.priority import urgency
from control_plane.scheduler.retraction import Retraction


class Preemption:
    """Running requests giving way to a more important newcomer when the running batch is full."""

    def __init__(self, running: RunningBatch, retraction: Retraction, priority_sign: int) -> None:
        self.running = running
        self.retraction = retraction
        self.priority_sign = priority_sign

    def preempt_for(self, req: Request, adder: PrefillAdder, preempted: list[Request]) -> bool:
        """Release running requests that `req` outranks, if enough of them free the room it needs;
        appends them to `preempted` (re-queued after the pass). Returns whether room was made."""
        sign = self.priority_sign
        # A parallel-sample group is never split: its members are not preemption candidates.
        candidates = [
            r for r in self.running.reqs if not r.finished and not r.preempted and not r.params.group
        ]
        candidates.sort(key=lambda r: (-urgency(r, sign), -r.wait_queue_entry_time))
        # Before the request is matched (docs/scheduler.md#priority-preemption, SGLang's order in
        # _get_new_batch_prefill_raw): the room it needs is reckoned from the prefix its previous round
        # left, none for a request never matched or since retracted or preempted. Matching first would
        # also refresh its cached prefix in the tree's LRU order on every blocked attempt.
        victims = adder.preempt_to_schedule(req, candidates)
        if victims is None:
            return False
        self.release(victims, preempted)
        return True

    def release(self, victims: list[Request], preempted: list[Request]) -> None:
        """Release the chosen victims for a re-prefill; appends them to `preempted`."""
        victim_ids = {id(v) for v in victims}
        in_batch_order = [r for r in self.running.reqs if id(r) in victim_ids]
        running_bs = len(self.running)
        # `remaining` counts down per release, as SGLang's release_counter (schedule_policy.py
        # preempt_to_schedule): the tree is asked to evict for the requests still running after each.
        for released, victim in enumerate(in_batch_order, start=1):
            victim.preempted = True
            if self.retraction.release_for_requeue(victim, remaining=running_bs - released):
                preempted.append(victim)
        # The running batch shrinks, which clears its batch_is_full (RunningBatch.keep).
        self.running.remove(in_batch_order)
