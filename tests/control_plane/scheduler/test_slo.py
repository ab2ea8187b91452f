"""SLO-aware admission and edf (docs/scheduler.md#slo-admission): an infeasible TTFT objective is
refused at once (RESOURCE_EXHAUSTED naming the objective), the prediction counts the queue ahead and
the cached prefix, edf orders by deadline, and TPOT misses are counted."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from control_plane.core.admission import _verdict
from control_plane.core.hub import _STATUS
from control_plane.core.inbox import Verdict
from control_plane.scheduler.records import QueueFull
from control_plane.scheduler.slo import SloUnmeetable
from control_plane.tenants.table import parse
from tests.control_plane.factories import make_scheduler, params, prompt
from tests.control_plane.fake_worker import FakeWorker

# 10 ms a step + 1 ms per prompt token: a 100-token prompt alone takes 10 + 10 + 100 + ... ms.
COST = (0.01, 0.001, 0.0, 0.0)


def test_an_infeasible_ttft_is_refused_at_once_naming_the_objective() -> None:
    sched = make_scheduler(slo_cost=COST)
    with pytest.raises(SloUnmeetable, match="ttft_slo_ms") as refused:
        sched.add_request("r", prompt(100), params(4, ttft_slo_ms=50.0))
    assert isinstance(refused.value, QueueFull)
    # Its own verdict (the tenant book counts it under ttft_slo_ms), RESOURCE_EXHAUSTED on the wire.
    assert _verdict(refused.value) is Verdict.SLO_UNMEETABLE
    assert _STATUS[Verdict.SLO_UNMEETABLE] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "r" not in sched.requests and not sched.waiting
    sched.add_request("s", prompt(100), params(4, ttft_slo_ms=200.0))
    assert [r.rid for r in sched.waiting] == ["s"]


def test_a_continuation_that_already_streamed_is_not_refused_for_its_ttft() -> None:
    """A request moved or handed over after its first token (generated_before > 0) met or missed
    its TTFT on the worker it left: refusing it here would abort a stream the client is reading
    (admit_orphan), for an objective that no longer applies. One with no token out yet is still
    checked."""
    sched = make_scheduler(slo_cost=COST)
    moved = dataclasses.replace(params(4, ttft_slo_ms=50.0), generated_before=3)
    sched.add_request("moved", prompt(100), moved)
    assert [r.rid for r in sched.waiting] == ["moved"]
    # Its prompt counts ahead of the next arrival, as any waiting request's does.
    with pytest.raises(SloUnmeetable):
        sched.add_request("next", prompt(100, 2), params(4, ttft_slo_ms=150.0))
    with pytest.raises(SloUnmeetable):
        sched.add_request("unstarted", prompt(100, 3), params(4, ttft_slo_ms=50.0))


def test_without_slo_cost_objectives_change_nothing() -> None:
    sched = make_scheduler()
    sched.add_request("r", prompt(100), params(4, ttft_slo_ms=1.0))
    assert sched.slo is None and [r.rid for r in sched.waiting] == ["r"]


def test_the_queue_ahead_counts() -> None:
    sched = make_scheduler(slo_cost=COST)
    for i in range(3):
        sched.add_request(f"q{i}", prompt(100, i + 1), params(4))
    # 400 prompt tokens to prefill before its first token: ~0.43 s.
    with pytest.raises(SloUnmeetable):
        sched.add_request("late", prompt(100), params(4, ttft_slo_ms=300.0))
    sched.add_request("patient", prompt(100), params(4, ttft_slo_ms=600.0))


def test_edf_counts_only_earlier_deadlines_and_orders_by_deadline() -> None:
    sched = make_scheduler(slo_cost=COST, schedule_policy="edf")
    for i in range(3):
        sched.add_request(f"q{i}", prompt(100, i + 1), params(4))  # no objective: after any with one
    sched.add_request("loose", prompt(50, 7), params(4, ttft_slo_ms=900.0))
    sched.add_request("tight", prompt(50, 8), params(4, ttft_slo_ms=150.0))
    plan = sched.next_plan()
    assert plan is not None
    assert [s.request_id for s in plan.new_seqs][:2] == ["tight", "loose"]


def test_a_cached_prefix_is_not_counted() -> None:
    sched = make_scheduler(slo_cost=COST)
    worker = FakeWorker(4096)
    sched.add_request("first", prompt(300), params(1))
    while not sched.is_idle:
        plan = sched.next_plan()
        if plan is not None:
            sched.apply_result(worker.run(plan))
        sched.take_updates()
    # 300 tokens cached: only the last few are prefilled, well within 100 ms.
    sched.add_request("again", [*prompt(300), 5], params(4, ttft_slo_ms=100.0))
    with pytest.raises(SloUnmeetable):
        sched.add_request("cold", prompt(301, 9), params(4, ttft_slo_ms=100.0))


def test_tenant_defaults_apply() -> None:
    sched = make_scheduler(slo_cost=COST, tenant_slos={"strict": (50.0, 0.0)})
    with pytest.raises(SloUnmeetable):
        sched.add_request("r", prompt(100), params(4, tenant="strict"))
    sched.add_request("s", prompt(100), params(4, tenant="lax"))


def test_a_running_request_that_will_miss_its_tpot_is_counted_once() -> None:
    sched = make_scheduler(slo_cost=COST)
    worker = FakeWorker(4096)
    sched.add_request("slow", prompt(20), params(6, tpot_slo_ms=5.0))  # every step takes >= 10 ms
    sched.add_request("fine", prompt(20, 2), params(6, tpot_slo_ms=500.0))
    counted = []
    while not sched.is_idle:
        plan = sched.next_plan()
        if plan is not None:
            assert sched.last_stats is not None
            counted.append(sched.last_stats.tpot_at_risk)
            sched.apply_result(worker.run(plan))
        sched.take_updates()
    assert sum(counted) == 1
    assert sched.slo is not None and sched.slo.tpot_at_risk_total == 1


def test_mixed_chunk_steps_pay_for_the_growing_running_batch() -> None:
    """With --enable-mixed-chunk each prefill step also decodes the running batch, whose context grows
    by the prompts prefilled on the way: the prediction is longer than without."""
    cost = (0.01, 0.001, 0.0001, 0.0)
    plain = make_scheduler(slo_cost=cost, chunked_prefill_size=64)
    mixed = make_scheduler(slo_cost=cost, chunked_prefill_size=64, enable_mixed_chunk=True)
    assert plain.slo is not None and mixed.slo is not None
    # 640 tokens: 10 steps; mixed adds c·640/2 a step.
    assert mixed.slo.predict_ttft_s(640, 100) == pytest.approx(
        plain.slo.predict_ttft_s(640, 100) + 10 * 0.032
    )
    # Overlap: nothing in flight, the prefill steps, then the step that publishes (no prompt tokens
    # planned lately: a bare step).
    assert plain.slo.predict_ttft_s(640, 100) == pytest.approx(0.01 + 10 * 0.01 + 0.64 + 0.0001 * 740)


def test_the_publishing_step_is_reckoned_at_the_recent_prompt_tokens_per_step() -> None:
    """The step after a request's prefill publishes its first token and prefills what arrived
    behind it: under load, about what the recent steps prefilled."""
    sched = make_scheduler(slo_cost=COST, chunked_prefill_size=64)
    assert sched.slo is not None
    idle = sched.slo.predict_ttft_s(10, 10)
    worker = FakeWorker(4096)
    for i in range(40):
        sched.add_request(f"q{i}", prompt(64, i + 1), params(1))
        plan = sched.next_plan()
        assert plan is not None
        sched.apply_result(worker.run(plan))
        sched.take_updates()
    busy = sched.slo.predict_ttft_s(10, 10)
    assert 0.001 * 50 < busy - idle < 0.001 * 64


def test_the_step_in_flight_counts_at_its_planned_size() -> None:
    """Under overlap a plan may be in flight when a request arrives: its first token waits for that
    step as planned (a 500-token prefill here: over 0.5 s), not for a decode step."""
    sched = make_scheduler(slo_cost=COST)
    sched.add_request("big", prompt(500), params(4))
    assert sched.next_plan() is not None  # in flight, its result not applied
    with pytest.raises(SloUnmeetable):
        sched.add_request("small", prompt(10, 3), params(4, ttft_slo_ms=400.0))
    sched.add_request("patient", prompt(10, 4), params(4, ttft_slo_ms=900.0))


def test_slo_refusals_replay_identically() -> None:
    """The header carries --slo-cost and the arrivals their objectives: a replay refuses the same
    requests and makes the same plans."""
    from control_plane.record.recorder import RecordingScheduler, recording_header
    from control_plane.record.replay import replay_scheduler
    from protos.worker import WorkerLimits
    from tests.control_plane.factories import make_config
    from tests.record.conftest import ListSink

    config = make_config(
        slo_cost=COST, schedule_policy="edf", enable_mixed_chunk=True, chunked_prefill_size=64
    )
    limits = WorkerLimits("w0", kv_capacity_tokens=4096, page_size=1, max_context=2048, vocab_size=1000)
    sink = ListSink()
    sched = RecordingScheduler(config, limits, sink)
    worker = FakeWorker(4096)
    refused = 0
    for i in range(12):
        try:
            sched.add_request(f"r{i}", prompt(60, i), params(8, ttft_slo_ms=150.0 + 40 * (i % 3)))
        except SloUnmeetable:
            refused += 1
        if i % 4 != 3:
            continue  # arrivals in bursts of four: the later ones of a burst wait behind the earlier
        plan = sched.next_plan()
        if plan is not None:
            sched.apply_result(worker.run(plan))
        sched.take_updates()
    while not sched.is_idle:
        plan = sched.next_plan()
        if plan is not None:
            sched.apply_result(worker.run(plan))
        sched.take_updates()
    assert 0 < refused < 12
    report = replay_scheduler([recording_header(config, limits, "test"), *sink.entries])
    assert report.identical, report.describe()


def test_the_default_entry_applies_to_unlisted_tenants_and_a_listed_one_keeps_its_own() -> None:
    """The scheduler is the one place a tenant's latency defaults are applied: the tenant file's
    [defaults] entry (under ANY_TENANT) covers every tenant it does not list."""
    slos = parse({"defaults": {"ttft_slo_ms": 50.0}, "tenants": {"lax": {}}}).slo_defaults()
    sched = make_scheduler(slo_cost=COST, tenant_slos=slos)
    with pytest.raises(SloUnmeetable):
        sched.add_request("r", prompt(100), params(4, tenant="anyone"))
    # A listed tenant that sets no objective has none, as its entry says.
    sched.add_request("s", prompt(100), params(4, tenant="lax"))


def test_a_reload_changes_the_objectives_the_scheduler_applies() -> None:
    sched = make_scheduler(slo_cost=COST)
    sched.add_request("before", prompt(100), params(4, tenant="t"))
    sched.config.retenant({}, parse({"tenants": {"t": {"ttft_slo_ms": 50.0}}}).slo_defaults())
    with pytest.raises(SloUnmeetable):
        sched.add_request("after", prompt(100, 3), params(4, tenant="t"))


def test_the_step_a_request_may_have_arrived_in_counts() -> None:
    """The engine takes arrivals between steps: a request may have arrived as the step last applied
    began, so that step's seconds count in its wait."""
    sched = make_scheduler(slo_cost=COST)
    assert sched.slo is not None
    fresh = sched.slo.predict_ttft_s(10, 10)
    sched.add_request("q", prompt(20), params(1))
    plan = sched.next_plan()
    assert plan is not None
    result = FakeWorker(4096).run(plan)
    sched.apply_result(dataclasses.replace(result, forward_s=0.25))
    sched.take_updates()
    # (and the publishing step's share of the 20 prompt tokens just planned)
    assert sched.slo.predict_ttft_s(10, 10) == pytest.approx(fresh + 0.25 + COST[1] * sched.slo.recent_tokens)
