"""Priority preemption on admission (SCHEDULER.md §2.4)."""

from __future__ import annotations

from control_plane.request import Request
from control_plane.scheduler.adder import PrefillAdder
from control_plane.scheduler.priority import urgency
from control_plane.scheduler.retraction import Retraction


class Preemption(Retraction):
    """Running requests giving way to a more important newcomer (§2.4)."""

    def _preempt_for(self, req: Request, adder: PrefillAdder, preempted: list[Request]) -> bool:
        """Priority preemption (§2.4): release running requests that the newcomer outranks."""
        sign = self.priority_sign
        candidates = [r for r in self.running.reqs if not r.finished and not r.preempted]
        candidates.sort(key=lambda r: (-urgency(r, sign), -r.wait_queue_entry_time))
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
