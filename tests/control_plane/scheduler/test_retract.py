"""Decode memory check and retraction (docs/scheduler.md#retraction; SGLang's test_retract_decode.py)."""

from __future__ import annotations

import numpy as np
import pytest

from control_plane.request import AbortCode, FinishKind, Request
from control_plane.scheduler.scheduler import OOM_LAST_REQUEST, Scheduler, StepStats
from protos.worker import StepPlan
from tests.control_plane.factories import EOS, FakeWorker, finishes, make_scheduler, params, prompt, run


def step(sched: Scheduler, worker: FakeWorker) -> tuple[StepPlan | None, StepStats | None]:
    plan = sched.next_plan()
    if plan is None:
        return None, None
    sched.apply_result(worker.run(plan))
    return plan, sched.last_stats


def start(sched: Scheduler, worker: FakeWorker, reqs: list[tuple[str, list[int], int]]) -> None:
    """Admit these (rid, prompt, max_new) in one prefill; the next plan merges and decodes them."""
    for rid, ids, max_new in reqs:
        sched.add_request(rid, ids, params(max_new))
    plan, _ = step(sched, worker)
    assert plan is not None and len(plan.extends) == len(reqs)


def fake_running(
    sched: Scheduler, shapes: list[tuple[int, int]], groups: list[str] | None = None
) -> list[Request]:
    """Running requests with (prompt length, outputs) each; only for ordering questions."""
    reqs = []
    for i, (prompt_len, outputs) in enumerate(shapes):
        group = groups[i] if groups else ""
        r = Request(rid=f"r{i}", origin_input_ids=prompt(prompt_len, i), params=params(100, group=group))
        r.output_ids = [7] * outputs
        r.max_new_tokens = 100
        reqs.append(r)
    # Requests without rows: the retraction order reads only what the Request objects say.
    objects = np.empty(len(reqs), dtype=object)
    objects[:] = reqs
    sched.running.append(objects, np.full(len(reqs), -1), np.zeros(len(reqs), dtype=np.int64))
    return reqs


def popped_first_to_last(sched: Scheduler) -> list[str]:
    return [sched.running.reqs[i].rid for i in reversed(sched.retraction.order())]


# --- order (docs/scheduler.md#retraction)
# -----------------------------------------------------------------------------------


def test_length_order_fewest_outputs_then_longest_prompt_then_later_position() -> None:
    sched = make_scheduler()
    fake_running(sched, [(10, 5), (50, 1), (20, 1), (50, 1), (5, 9)])
    assert popped_first_to_last(sched) == ["r3", "r1", "r2", "r0", "r4"]


def test_priority_order_retracts_least_important_first() -> None:
    sched = make_scheduler(enable_priority_scheduling=True, retraction_policy="priority")
    reqs = fake_running(sched, [(10, 1), (10, 9), (10, 5), (99, 5)])
    for r, prio in zip(reqs, (9, 1, 1, 5), strict=True):
        r.priority = prio
    assert popped_first_to_last(sched) == ["r2", "r1", "r3", "r0"]


def test_priority_order_low_values_first() -> None:
    sched = make_scheduler(
        enable_priority_scheduling=True, retraction_policy="priority", schedule_low_priority_values_first=True
    )
    reqs = fake_running(sched, [(10, 1), (10, 9), (10, 5)])
    for r, prio in zip(reqs, (9, 1, 1), strict=True):
        r.priority = prio
    assert popped_first_to_last(sched) == ["r0", "r2", "r1"]


def test_groups_are_kept_first() -> None:
    sched = make_scheduler()
    fake_running(sched, [(10, 1), (10, 9), (10, 1), (10, 50)], groups=["g", "", "g", ""])
    assert popped_first_to_last(sched)[:2] == ["r1", "r3"]


# --- the loop (docs/scheduler.md#decode-memory-check, #retraction)
# ----------------------------------------------------------------------------


def test_test_retract_retracts_exactly_one_every_third_forward() -> None:
    sched = make_scheduler(test_retract=True)
    worker = FakeWorker(4096, eos=EOS)
    arrivals = [(0, f"r{i}", prompt(10 + i, i), params(30)) for i in range(4)]
    events: list[tuple[int, int]] = []

    def record(s: Scheduler, _: int) -> None:
        if s.last_stats is not None and s.last_stats.retracted:
            # forward_ct has counted the batch that was planned after the decision.
            events.append((s.forward_ct - 1, len(s.last_stats.retracted)))
            s.last_stats.retracted = []

    out = run(sched, worker, arrivals, on_step=record)
    assert events and all(ct % 3 == 0 and n == 1 for ct, n in events)
    reference = run(make_scheduler(), FakeWorker(4096, eos=EOS), arrivals)
    assert out.tokens == reference.tokens


def test_single_running_request_is_never_retracted() -> None:
    sched = make_scheduler(test_retract=True)
    out = run(sched, FakeWorker(4096, eos=EOS), [(0, "solo", prompt(10), params(20))])
    assert sched.num_retracted_total == 0 and len(out.tokens["solo"]) == 20


def test_retracted_requests_requeue_at_the_back_with_their_outputs() -> None:
    # The running cap (2) keeps "queued" waiting, so that this step decodes.
    sched = make_scheduler(test_retract=True, max_running_requests=2)
    worker = FakeWorker(4096, eos=EOS)
    start(sched, worker, [("short", prompt(5, 1), 50), ("long", prompt(40, 2), 50)])
    sched.add_request("queued", prompt(8, 3), params(4))
    sched.forward_ct = 3
    plan, stats = step(sched, worker)
    assert stats is not None and stats.retracted == ["long"]
    long = sched.waiting[-1]
    assert [r.rid for r in sched.waiting] == ["queued", "long"]
    assert len(long.output_ids) == 1 and long.is_retracted and long.retracted_stain
    assert long.handle == -1 and long.req_pool_idx == -1 and long.kv_committed_len == 0
    assert plan is not None and plan.decodes.handles.tolist() == [1]


def test_ratio_after_retraction_uses_the_kept_requests() -> None:
    sched = make_scheduler(test_retract=True)
    worker = FakeWorker(4096, eos=EOS)
    start(sched, worker, [("a", prompt(5, 1), 300), ("b", prompt(6, 2), 50), ("c", prompt(60, 3), 70)])
    sched.forward_ct = 3
    _, stats = step(sched, worker)
    assert stats is not None and stats.retracted == ["c"]
    kept = sched.running.reqs
    expected = min(1.0, (sum(len(r.output_ids) - 1 for r in kept) + 20 * len(kept)) / (300 + 50 + 1))
    # `output_ids` grew by the decode that ran after the retraction; the estimate came before it.
    assert [r.rid for r in kept] == ["a", "b"]
    assert sched.ratio.current == pytest.approx(expected)
    assert stats.ratio_before_retract == pytest.approx(0.7)


def test_oom_retracts_others_then_keeps_the_last_when_it_fits() -> None:
    sched = make_scheduler(capacity=512)
    worker = FakeWorker(512, eos=EOS)
    start(sched, worker, [("a", prompt(10, 1), 100), ("b", prompt(20, 2), 100)])
    assert sched.kv.allocator.alloc(sched.kv.available_size()) is not None  # something took every free slot
    plan = sched.next_plan()
    assert [r.rid for r in sched.waiting] == ["b"] and [r.rid for r in sched.running.reqs] == ["a"]
    assert plan is not None and plan.releases.tolist() == [2] and plan.decodes.handles.tolist() == [1]
    assert sched.last_stats is not None and sched.last_stats.kv_full


def test_oom_aborts_the_last_request_with_sglangs_message() -> None:
    sched = make_scheduler(capacity=512)
    worker = FakeWorker(512, eos=EOS)
    start(sched, worker, [("a", prompt(10, 1), 100)])
    assert sched.kv.allocator.alloc(sched.kv.available_size()) is not None
    plan = sched.next_plan()
    reason = finishes(sched.take_updates())["a"]
    assert not sched.waiting and not len(sched.running)
    assert reason.kind is FinishKind.ABORT and reason.code is AbortCode.INTERNAL
    assert reason.message == OOM_LAST_REQUEST
    assert OOM_LAST_REQUEST.startswith("Out of memory even after retracting all other requests")
    assert plan is not None and plan.releases.tolist() == [1] and not len(plan.decodes)
    # The step reports it, for SGLang's log line (docs/scheduler.md#retraction) "retract_decode: aborted last
    # request a due to OOM".
    assert sched.last_stats is not None and sched.last_stats.oom_aborted == ["a"]
    assert sched.ratio.current == 0.0  # the estimate over an empty batch; the next decay lifts it
    sched.ratio.decay_step()
    assert sched.ratio.current == sched.ratio.min


def test_real_kv_pressure_retracts_and_outputs_are_unchanged() -> None:
    # Staggered arrivals each fit when admitted, but a low ratio under-reserves their future decode.
    arrivals = [(10 * i, f"r{i}", prompt(20 + i, i), params(150)) for i in range(6)]
    sched = make_scheduler(capacity=400, chunked_prefill_size=64, init_new_token_ratio=0.2)
    full: list[float] = []

    def watch(s: Scheduler, _: int) -> None:
        if s.last_stats is not None and s.last_stats.kv_full:
            full.append(s.ratio.current)
            s.last_stats.kv_full = False

    out = run(sched, FakeWorker(400, eos=EOS), arrivals, on_step=watch)
    assert full, "the pool never filled up"
    assert sched.num_retracted_total > 0
    assert all(f.kind is FinishKind.LENGTH for f in out.finished.values())
    reference = run(
        make_scheduler(capacity=8192, chunked_prefill_size=None), FakeWorker(8192, eos=EOS), arrivals
    )
    assert out.tokens == reference.tokens
    assert sched.kv.available_size() + sched.kv.evictable_size() == 400


def test_group_is_never_partially_retracted() -> None:
    sched = make_scheduler(test_retract=True)
    worker = FakeWorker(4096, eos=EOS)
    arrivals = [(0, f"g{i}", prompt(10, 1), params(12, group="g")) for i in range(3)]
    arrivals += [(0, "solo1", prompt(10, 2), params(12)), (0, "solo2", prompt(11, 3), params(12))]

    def check(s: Scheduler, _: int) -> None:
        assert sum(r.params.group == "g" for r in s.running.reqs) in (0, 3)
        assert not any(r.params.group for r in s.waiting if r.retracted_stain)

    out = run(sched, worker, arrivals, on_step=check)
    assert sched.num_retracted_total > 0
    assert len({out.finished[f"g{i}"] for i in range(3)}) == 1


def test_retraction_drops_the_pending_remap_of_the_released_handle() -> None:
    # r3's final prefill duplicates r2's cached prompt, so its result queues a slot remap; the
    # next plan retracts r3 (TEST_RETRACT) and must not send the remap for the released handle.
    shared = prompt(100, seed=7)
    arrivals = [
        (0, "r0", prompt(1, 0), params(2)),
        (0, "r1", prompt(1, 1), params(1)),
        (0, "r2", shared + prompt(1, 2), params(1)),
        (0, "r3", shared + prompt(1, 3), params(2)),
    ]
    sched = make_scheduler(capacity=160, chunked_prefill_size=64, test_retract=True)
    out = run(sched, FakeWorker(160, eos=EOS), arrivals)
    assert sched.num_retracted_total == 1
    for plan in out.plans:
        assert not set(plan.releases.tolist()) & {r.handle for r in plan.remaps}
    assert out.tokens == run(make_scheduler(), FakeWorker(4096, eos=EOS), arrivals).tokens


def test_test_retract_never_aborts_a_sample_group() -> None:
    """TEST_RETRACT exercises retraction; with only a sample group running it retracts nothing."""
    from tests.control_plane.factories import make_scheduler as _make
    from tests.control_plane.factories import params as _params
    from tests.control_plane.factories import prompt as _prompt
    from tests.control_plane.factories import run as _run

    sched = _make(capacity=4096, test_retract=True)
    arrivals = [(0, f"g/{i}", _prompt(12, 1), _params(20, ignore_eos=True, group="g")) for i in range(3)]
    out = _run(sched, FakeWorker(4096), arrivals)
    assert all(reason.kind.value == "length" for reason in out.finished.values())
    assert all(len(tokens) == 20 for tokens in out.tokens.values())
    assert sched.num_retracted_total == 0
