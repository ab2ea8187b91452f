"""A session recorded with overlap scheduling (plan N+1 before result N) replays identically."""

from __future__ import annotations

from collections import deque

from control_plane.record.entries import ApplyResult, Entry, NextPlan
from control_plane.record.recorder import RecordingScheduler, recording_header
from control_plane.record.replay import replay_scheduler, replay_worker
from control_plane.request import AbortCode, FinishReason
from protos.worker import StepResult
from tests.control_plane.factories import EOS, add, make_config, make_scheduler, params, prompt
from tests.control_plane.fake_worker import FakeWorker
from tests.record.conftest import ListSink


def record_overlapped(capacity: int = 320) -> list[Entry]:
    """A scripted engine with two plans in flight: arrivals over time, KV pressure (retractions), a
    stop string and an abort while a plan is in flight."""
    config = make_config(chunked_prefill_size=32, init_new_token_ratio=0.05, test_retract=True)
    limits = make_scheduler(capacity=capacity).limits
    sink = ListSink()
    sched = RecordingScheduler(config, limits, sink)
    worker = FakeWorker(capacity, eos=EOS, eos_every=11)
    arrivals = deque((2 * i, f"r{i}", prompt(10 + 7 * i, i), params(40)) for i in range(10))
    in_flight: deque[StepResult] = deque()
    for step in range(2000):
        while arrivals and arrivals[0][0] <= step:
            _, rid, ids, p = arrivals.popleft()
            add(sched, rid, ids, p)
        if step == 9 and "r1" in sched.requests:
            sched.abort("r1", FinishReason.abort("cancelled", AbortCode.CANCELLED))
        if step == 14 and "r3" in sched.requests:
            sched.finish("r3", FinishReason.stop("stop string"))
        plan = sched.next_plan()
        sched.take_updates()
        if plan is None and not in_flight:
            if not arrivals and sched.is_idle:
                break
            continue
        if plan is not None:
            in_flight.append(worker.run(plan))
        if len(in_flight) == 2 or plan is None:
            sched.apply_result(in_flight.popleft())
            sched.take_updates()
    assert sched.is_idle and sched.num_retracted_total > 0
    return [recording_header(config, limits, "test"), *sink.entries]


def test_an_overlapped_recording_replays_identically() -> None:
    entries = record_overlapped()
    # Plans ran ahead of results: plan N+1 was recorded before result N, never more than 2 ahead.
    ahead = []
    for entry in entries:
        if isinstance(entry, NextPlan) and entry.plan is not None:
            ahead.append((ahead[-1] if ahead else 0) + 1)
        elif isinstance(entry, ApplyResult):
            ahead.append(ahead[-1] - 1)
    assert min(ahead) >= 0 and max(ahead) == 2
    report = replay_scheduler(entries)
    assert report.identical, report.describe()
    assert report.counts["plans"] == report.counts["results"] > 0
    assert report.counts["aborts"] == 1 and report.counts["finishes"] == 1


def test_worker_replay_matches_results_to_plans_in_order() -> None:
    entries = record_overlapped()
    report = replay_worker(entries, FakeWorker(320, eos=EOS, eos_every=11).run)
    assert report.identical, report.describe()
    assert report.counts["plans"] == report.counts["results"] > 0
