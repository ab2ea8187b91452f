"""Priority scheduling end to end (docs/scheduler.md#intake, #priority-preemption; SGLang's
test_priority_scheduling.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from control_plane.request import FinishKind
from control_plane.scheduler.scheduler import (
    PRIORITY_EVICTED,
    QUEUE_FULL,
    QueueFull,
    RequestRejected,
    Scheduler,
)
from tests.control_plane.factories import EOS, FakeWorker, make_scheduler, params, prompt, run


def priority_scheduler(**config: Any) -> Scheduler:
    return make_scheduler(enable_priority_scheduling=True, **config)


def test_queue_full_rejects_the_newcomer_without_priority_scheduling() -> None:
    sched = make_scheduler(max_queued_requests=3)
    for i in range(3):
        sched.add_request(f"q{i}", prompt(10, i), params(4))
    with pytest.raises(QueueFull, match=re.escape(QUEUE_FULL)):
        sched.add_request("late", prompt(10, 9), params(4))
    assert [r.rid for r in sched.waiting] == ["q0", "q1", "q2"]
    assert QUEUE_FULL == "The request queue is full."


def test_queue_full_with_priority_evicts_the_least_important_queued_request() -> None:
    sched = priority_scheduler(max_queued_requests=3)
    for rid, prio in (("p5", 5), ("p1_old", 1), ("p1_new", 1)):
        sched.add_request(rid, prompt(10, len(rid)), params(4, priority=prio))
    sched.add_request("p9", prompt(10, 9), params(4, priority=9))
    updates = sched.take_updates()
    # Among equal priorities the newer entry is evicted.
    assert [(f.rid, f.reason.message) for f in updates.finished] == [("p1_new", PRIORITY_EVICTED)]
    assert PRIORITY_EVICTED == "The request is aborted by a higher priority request."
    assert [r.rid for r in sched.waiting] == ["p5", "p1_old", "p9"]


def test_queue_full_with_priority_rejects_a_newcomer_that_is_not_better() -> None:
    sched = priority_scheduler(max_queued_requests=2)
    sched.add_request("a", prompt(10, 1), params(4, priority=3))
    sched.add_request("b", prompt(10, 2), params(4, priority=3))
    with pytest.raises(QueueFull):
        sched.add_request("same", prompt(10, 3), params(4, priority=3))
    assert sched.take_updates().empty


def test_queue_full_low_values_first_evicts_the_largest_value() -> None:
    sched = priority_scheduler(max_queued_requests=2, schedule_low_priority_values_first=True)
    sched.add_request("v1", prompt(10, 1), params(4, priority=1))
    sched.add_request("v7", prompt(10, 2), params(4, priority=7))
    sched.add_request("v3", prompt(10, 3), params(4, priority=3))
    assert [f.rid for f in sched.take_updates().finished] == ["v7"]


def test_default_priority_is_least_important() -> None:
    sched = priority_scheduler()
    sched.add_request("none", prompt(10, 1), params(4))
    sched.add_request("zero", prompt(10, 2), params(4, priority=-1000))
    sched.policy.order(sched.waiting, [])
    assert [r.rid for r in sched.waiting] == ["zero", "none"]


def test_priority_when_disabled_may_be_rejected() -> None:
    sched = make_scheduler(abort_on_priority_when_disabled=True)
    with pytest.raises(RequestRejected):
        sched.add_request("p", prompt(10), params(4, priority=3))
    sched.add_request("plain", prompt(10), params(4))


PREEMPTED: dict[int, list[str]] = {}


def preemption_run(new_priority: int, **config: Any) -> tuple[dict[str, list[int]], list[list[int]], dict]:
    sched = priority_scheduler(max_running_requests=1, **config)
    arrivals = [
        (0, "low", prompt(20, 1), params(12, priority=0)),
        (3, "new", prompt(20, 2), params(4, priority=new_priority)),
    ]
    requeued = PREEMPTED.setdefault(new_priority, [])
    requeued.clear()

    def watch(s: Scheduler, step: int) -> None:
        # A waiting request with output was running: it was preempted and re-queued.
        requeued.extend(r.rid for r in s.waiting if r.output_ids and r.rid not in requeued)

    out = run(sched, FakeWorker(4096, eos=EOS), arrivals, on_step=watch)
    handles = [p.extends.handles.tolist() + p.decodes.handles.tolist() for p in out.plans]
    return out.tokens, handles, out.finished


def test_preemption_when_the_gap_exceeds_the_threshold() -> None:
    tokens, handles, finished = preemption_run(20)
    # "low" (handle 1) decodes, "new" arrives at step 3 and preempts it; "low" later re-prefills
    # under a fresh handle and finishes with its tokens intact.
    assert handles[:4] == [[1], [1], [1], [2]]
    assert PREEMPTED[20] == ["low"]  # released and re-queued, not merely paused
    assert all(f.kind is FinishKind.LENGTH for f in finished.values())
    assert len(tokens["low"]) == 12 and len(tokens["new"]) == 4
    reference, _, _ = preemption_run(10)
    assert tokens == reference


def test_no_preemption_at_exactly_the_threshold() -> None:
    _, handles, _ = preemption_run(10)
    first_new = next(i for i, h in enumerate(handles) if 2 in h)
    assert all(h in ([1], []) for h in handles[:first_new])
    assert first_new > 10  # "new" waits for "low" (12 tokens) to finish


def test_no_preemption_when_disabled() -> None:
    _, handles, _ = preemption_run(20, disable_priority_preemption=True)
    assert next(i for i, h in enumerate(handles) if 2 in h) > 10


@pytest.mark.parametrize(
    ("low_first", "prios", "new_prio", "victim"), [(False, (0, 5), 30, "p0"), (True, (0, 5), -20, "p5")]
)
def test_preemption_victim_is_the_least_important_running(
    low_first: bool, prios: tuple[int, int], new_prio: int, victim: str
) -> None:
    sched = priority_scheduler(max_running_requests=2, schedule_low_priority_values_first=low_first)
    worker = FakeWorker(4096, eos=EOS)
    arrivals = [(0, f"p{p}", prompt(20, p), params(30, priority=p)) for p in prios]
    arrivals.append((3, "new", prompt(20, 9), params(4, priority=new_prio)))
    retracted: list[str] = []

    def watch(s: Scheduler, step: int) -> None:
        if step == 4:
            retracted.extend(r.rid for r in s.waiting)

    out = run(sched, worker, arrivals, on_step=watch)
    assert retracted == [victim]
    assert sorted(out.finished) == ["new", "p0", "p5"]


def test_running_never_exceeds_the_cap_under_preemption() -> None:
    sched = priority_scheduler(max_running_requests=2, max_queued_requests=3)
    worker = FakeWorker(4096, eos=EOS)
    arrivals = [(i, f"r{i}", prompt(16, i), params(8, priority=(i * 37) % 50)) for i in range(12)]
    rejected: list[str] = []
    preempted: set[str] = set()

    def check(s: Scheduler, step: int) -> None:
        assert len(s.running) <= 2 and len(s.waiting) <= 3
        # A waiting request that has output was running: it was preempted.
        preempted.update(r.rid for r in s.waiting if r.output_ids)

    sched_add = sched.add_request

    def add(rid, ids, p, uid=0):  # type: ignore[no-untyped-def]
        try:
            return sched_add(rid, ids, p, uid)
        except QueueFull:
            rejected.append(rid)
            return None

    sched.add_request = add  # type: ignore[method-assign]
    out = run(sched, worker, arrivals, on_step=check)
    assert set(out.finished) | set(rejected) == {f"r{i}" for i in range(12)}
    assert preempted, "the test is about preemption: some request must have been preempted"
