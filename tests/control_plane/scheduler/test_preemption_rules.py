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
from protos.worker import StepKind
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


def _plan_rids(sched: Scheduler, handles: list[int]) -> list[str]:
    return [sched.by_handle[h].rid for h in handles]


def test_the_room_to_free_counts_the_fill_of_the_newcomers_last_match_not_its_whole_prompt() -> None:
    """SGLang reckons `need` from `len(full_untruncated_fill_ids) - len(prefix_indices)`, and a request
    never matched has an empty fill: the 2,000-token prompt of "high" counts for nothing there. Two
    priority-0 requests at cap 2 on a 3,000-token pool each reserve ~347 tokens; "high" (max_new 500)
    then needs 500 − 2,102 < 0: one victim is enough (the least important, most recently queued, "l2"),
    and "l1" keeps decoding beside "high". Counting the whole prompt (2,000 + 500 − 2,102 = 398 > 347)
    took both, and "l1" came back through a re-prefill."""
    sched = make_scheduler(
        capacity=3000, max_context=8192, enable_priority_scheduling=True, max_running_requests=2
    )
    worker = FakeWorker(3000, eos=EOS)
    for rid, seed in (("l1", 1), ("l2", 2)):
        sched.add_request(rid, prompt(100, seed), params(500, priority=0, ignore_eos=True))
    for _ in range(3):
        _step(sched, worker)
    sched.add_request("high", prompt(2000, 9), params(500, priority=50, ignore_eos=True))
    plan = _step(sched, worker)
    assert _plan_rids(sched, plan.extends.handles.tolist()) == ["high"]
    assert [r.rid for r in sched.waiting] == ["l2"]
    assert [r.rid for r in sched.running.reqs] == ["l1"]
    plan = _step(sched, worker)
    assert plan.kind is StepKind.DECODE
    assert _plan_rids(sched, plan.decodes.handles.tolist()) == ["l1", "high"]


def test_a_retracted_newcomer_counts_the_fill_of_its_last_admission() -> None:
    """After a retraction SGLang's fill is stale (`reset_for_retract` leaves it): prompt plus the
    outputs the request had when it was last admitted, not those it generated since."""
    sched = make_scheduler(capacity=400, enable_priority_scheduling=True, max_running_requests=2)
    worker = FakeWorker(400, eos=EOS)
    sched.add_request("a", prompt(20, 1), params(100, priority=0, ignore_eos=True))
    _step(sched, worker)
    req = sched.requests["a"]
    assert req.matched_fill_len == 20
    for _ in range(5):
        _step(sched, worker)
    assert req.num_outputs == 6
    sched.retraction.release_for_requeue(req, remaining=0)
    sched.running.remove([req])
    sched.intake.requeue(req)
    assert req.matched_fill_len == 20 and req.seqlen == 26
    _step(sched, worker)  # re-admitted: matched again, prompt plus its six outputs
    assert req.matched_fill_len == 26


def test_a_mixed_step_refreshes_the_fill_of_the_requests_it_decodes() -> None:
    """SGLang's mix_with_running refreshes each running request's fill: a later retraction or preemption
    then reckons from the sequence as it was at that mixed step."""
    sched = make_scheduler(capacity=2000, enable_mixed_chunk=True, chunked_prefill_size=64)
    worker = FakeWorker(2000, eos=EOS)
    sched.add_request("a", prompt(20, 1), params(100, ignore_eos=True))
    for _ in range(4):
        _step(sched, worker)
    a = sched.requests["a"]
    assert a.matched_fill_len == 20 and a.seqlen == 24
    sched.add_request("b", prompt(30, 2), params(10, ignore_eos=True))
    plan = _step(sched, worker)
    assert plan.kind is StepKind.MIXED
    assert a.matched_fill_len == 24 and a.seqlen == 25
