"""Priority preemption details (docs/scheduler.md#priority-preemption, #admission-loop step 9b) and sample
groups under pressure.

SGLang: `schedule_policy.py:PrefillAdder.preempt_to_schedule` (victims released with a
`remaining` that counts down per release; need = untruncated fill ids minus the current prefix,
plus min(max_new_tokens, 4096), minus rem_total_tokens) and `scheduler.py:_get_new_batch_prefill_raw`
(running_bs is computed once per pass, so the slot limit does not grow with this pass's victims).
"""

from __future__ import annotations

from typing import Any

from control_plane.request import FinishKind
from control_plane.scheduler.retraction import GROUP_ABORTED
from control_plane.scheduler.scheduler import Scheduler
from tests.control_plane.factories import EOS, FakeWorker, finishes, make_scheduler, params, prompt


def _step(sched: Scheduler, worker: FakeWorker) -> Any:
    plan = sched.next_plan()
    assert plan is not None
    sched.apply_result(worker.run(plan))
    sched.take_updates()
    return plan


def _two_low_running() -> tuple[Scheduler, FakeWorker]:
    """Two priority-0 requests (20-token prompts, 100 new tokens) decoding on a 400-token pool, cap 2."""
    sched = make_scheduler(capacity=400, enable_priority_scheduling=True, max_running_requests=2)
    worker = FakeWorker(400, eos=EOS)
    for rid, seed in (("l1", 1), ("l2", 2)):
        sched.add_request(rid, prompt(20, seed), params(100, priority=0, ignore_eos=True))
    for _ in range(3):
        _step(sched, worker)
    assert [r.rid for r in sched.running.reqs] == ["l1", "l2"]
    return sched, worker


def test_victims_are_released_with_a_remaining_count_that_counts_down() -> None:
    sched, worker = _two_low_running()
    # 20 + min(330, 4096) tokens cannot fit beside both (each reserves 0.7 of its ~97 tokens left):
    # the newcomer needs both running requests' reservations, so both are preempted.
    sched.add_request("high", prompt(20, 9), params(330, priority=50, ignore_eos=True))
    calls: list[int] = []
    release = sched.kv.release_req

    def spy(req, remaining, steps):  # type: ignore[no-untyped-def]
        calls.append(remaining)
        return release(req, remaining, steps)

    sched.kv.release_req = spy  # type: ignore[method-assign]
    plan = _step(sched, worker)
    assert {r.rid for r in sched.waiting} == {"l1", "l2"}
    assert plan.extends.handles.tolist() == [sched.requests["high"].handle]
    # Two running when the pass began: the first victim leaves 1 still running, the second 0.
    assert calls == [1, 0]


def test_the_slot_limit_does_not_grow_with_this_passes_victims() -> None:
    """Cap 2 and both slots taken when the pass begins: "high" preempts both; "small" (admissible by
    tokens, after "high" in queue order) must still wait for the next pass, since the pass's running
    batch size counts the victims until the pass ends."""
    sched, worker = _two_low_running()
    sched.add_request("high", prompt(20, 9), params(330, priority=50, ignore_eos=True))
    sched.add_request("small", prompt(4, 7), params(2, priority=0, ignore_eos=True))
    plan = _step(sched, worker)
    admitted = {sched.by_handle[h].rid for h in plan.extends.handles.tolist() if h in sched.by_handle}
    assert admitted == {"high"}
    assert sched.waiting[0].rid == "small"
    plan = _step(sched, worker)  # the next pass: one slot is free again
    assert sched.requests["small"].handle in plan.extends.handles.tolist()


def test_a_sample_group_is_never_split_by_preemption() -> None:
    sched = make_scheduler(capacity=400, enable_priority_scheduling=True, max_running_requests=2)
    worker = FakeWorker(400, eos=EOS)
    for i in range(2):
        sched.add_request(f"g/{i}", prompt(20, 1), params(100, priority=0, ignore_eos=True, group="g"))
    for _ in range(3):
        _step(sched, worker)
    sched.add_request("high", prompt(20, 9), params(20, priority=50, ignore_eos=True))
    _step(sched, worker)
    assert [r.rid for r in sched.running.reqs] == ["g/0", "g/1"]
    assert [r.rid for r in sched.waiting] == ["high"]


def test_a_group_aborted_for_memory_takes_its_waiting_members_with_it() -> None:
    """A 3-sample group under a cap of 2: two members decode, the third waits for a slot. Then the
    pool runs out (every free slot taken, as another tenant's KV would): retraction reaches a group
    member, so the group is aborted whole — the member still waiting too, so no sample of the call
    outlives the others (before, the waiting one went on to run alone)."""
    sched = make_scheduler(capacity=400, max_running_requests=2)
    worker = FakeWorker(400, eos=EOS)
    for i in range(3):
        sched.add_request(f"g/{i}", prompt(10, 1), params(60, ignore_eos=True, group="g"))
    for _ in range(3):
        _step(sched, worker)
    assert [r.rid for r in sched.running.reqs] == ["g/0", "g/1"] and [r.rid for r in sched.waiting] == ["g/2"]
    assert sched.kv.allocator.alloc(sched.kv.available_size()) is not None
    plan = sched.next_plan()
    updates = finishes(sched.take_updates())
    assert {rid: (r.kind, r.message) for rid, r in updates.items()} == {
        rid: (FinishKind.ABORT, GROUP_ABORTED) for rid in ("g/0", "g/1", "g/2")
    }
    assert not sched.waiting and not len(sched.running)
    assert plan is not None and sorted(plan.releases.tolist()) == [1, 2]
