"""The step loop's log lines and figures (docs/scheduler.md#decode-memory-check, #retraction,
#logs-and-metrics)."""

from __future__ import annotations

import structlog

from control_plane.core.step_log import StepLog, oom_abort_line
from control_plane.metrics import REGISTRY
from control_plane.scheduler.scheduler import StepStats
from protos.worker import DecodeWork, StepKind, StepPlan
from tests.control_plane.factories import make_scheduler


def _gauge(name: str, worker: str) -> float | None:
    return REGISTRY.get_sample_value(f"stepwise:{name}", {"worker": worker})


def _decode_plan(step: int) -> StepPlan:
    import numpy as np

    return StepPlan(step, StepKind.DECODE, decodes=DecodeWork(np.array([1]), np.array([7])))


def test_retraction_gauge_is_per_step_and_the_oom_abort_is_logged() -> None:
    log = StepLog("w-steplog", decode_log_interval=40, log=structlog.get_logger("test"))
    sched = make_scheduler()
    retracting = StepStats(1, StepKind.DECODE, retracted=["a", "b"], kv_full=True, oom_aborted=["c"])
    with structlog.testing.capture_logs() as logs:
        log.record(_decode_plan(1), retracting, sched)
    assert _gauge("num_retracted_reqs", "w-steplog") == 2
    assert {
        "event": "retract_decode: aborted last request c due to OOM",
        "log_level": "error",
        "step": 1,
    } in logs
    assert oom_abort_line("c") == "retract_decode: aborted last request c due to OOM"
    log.record(_decode_plan(2), StepStats(2, StepKind.DECODE), sched)
    # SGLang's gauge describes the last step, not the last retraction (it went back to 0 before).
    assert _gauge("num_retracted_reqs", "w-steplog") == 0


def test_cache_hit_rate_leaves_out_reprocessed_retracted_work() -> None:
    log = StepLog("w-hitrate", decode_log_interval=40, log=structlog.get_logger("test"))
    sched = make_scheduler()
    prefill = StepPlan(1, StepKind.PREFILL)
    with structlog.testing.capture_logs():
        log.record(
            prefill,
            StepStats(1, StepKind.PREFILL, new_tokens=30, cached_tokens=10, cache_hit_rate=0.25),
            sched,
        )
    assert _gauge("cache_hit_rate", "w-hitrate") == 0.25
    log.record(_decode_plan(2), StepStats(2, StepKind.DECODE), sched)
    assert _gauge("cache_hit_rate", "w-hitrate") == 0.0  # decode steps report 0, as SGLang's do


def test_a_retracted_requests_cache_hits_do_not_count_towards_the_hit_rate() -> None:
    """docs/scheduler.md#prefill-adder-budgets, #logs-and-metrics: work re-done for a retracted request
    goes to reprocessed_log_* and out of the rate. Two requests decode; TEST_RETRACT retracts one at the
    third forward; its prompt was cached in
    the tree at its prefill, so re-admitting it hits the cache — but that hit is its own old work."""
    from tests.control_plane.factories import params, prompt
    from tests.control_plane.fake_worker import FakeWorker

    sched = make_scheduler(capacity=4096, test_retract=True)
    worker = FakeWorker(4096)
    for rid, seed in (("a", 1), ("b", 2)):
        sched.add_request(rid, prompt(40, seed), params(20, ignore_eos=True))
    readmissions = []
    for _ in range(12):
        plan = sched.next_plan()
        assert plan is not None
        stats = sched.last_stats
        assert stats is not None
        if plan.kind is StepKind.PREFILL and sched.num_retracted_total:
            readmissions.append(stats)
        sched.apply_result(worker.run(plan))
        sched.take_updates()
    assert readmissions, "the retracted request came back"
    back = readmissions[0]
    assert back.cached_tokens >= 39  # its prompt (less the last token) was in the tree
    assert back.cache_hit_rate == 0.0
