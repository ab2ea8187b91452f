"""Benchmark of the scheduler's decode hot path (not a test): `python bench/bench_scheduler.py`.

With 256 and 1024 running requests on a pool large enough that nothing is retracted, it times
`next_plan` (planning one decode step) and `apply_result` (appending the sampled tokens) separately,
driving the scheduler with the slot-checking fake worker (whose own time is not counted).
Goal: next_plan p50 ≤ 0.5 ms per decode step at 1024 running.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from control_plane.scheduler.plan import StepKind
from control_plane.scheduler.scheduler import Scheduler
from tests.control_plane.factories import make_scheduler, params, prompt
from tests.control_plane.fake_worker import FakeWorker

PROMPT_LEN = 32
CAPACITY = 1 << 21


def fill(running: int) -> tuple[Scheduler, FakeWorker]:
    """A scheduler with `running` requests admitted, prefilled and merged into the running batch."""
    sched = make_scheduler(capacity=CAPACITY, max_context=2048, max_running_requests=1024)
    worker = FakeWorker(CAPACITY)
    for i in range(running):
        sched.add_request(f"r{i}", prompt(PROMPT_LEN, seed=i), params(1000, ignore_eos=True))
    while sched.waiting or sched.chunked_req is not None:
        plan = sched.next_plan()
        assert plan is not None and plan.kind is StepKind.PREFILL
        sched.apply_result(worker.run(plan))
    return sched, worker


def measure(running: int, steps: int) -> tuple[list[int], list[int]]:
    sched, worker = fill(running)
    plan_ns, apply_ns = [], []
    for _ in range(steps):
        start = time.perf_counter_ns()
        plan = sched.next_plan()
        plan_ns.append(time.perf_counter_ns() - start)
        assert plan is not None and plan.kind is StepKind.DECODE and len(plan.decodes) == running
        result = worker.run(plan)
        start = time.perf_counter_ns()
        sched.apply_result(result)
        sched.take_updates()
        apply_ns.append(time.perf_counter_ns() - start)
    assert sched.num_retracted_total == 0
    return plan_ns, apply_ns


def summary(samples_ns: list[int]) -> str:
    ms = np.asarray(samples_ns[1:]) / 1e6  # the first decode step merges the batch: not typical
    return f"p50 {np.percentile(ms, 50):6.3f} ms  p99 {np.percentile(ms, 99):6.3f} ms  (n={len(ms)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="decode steps measured per size")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--profile", action="store_true", help="cProfile next_plan at the largest size")
    args = parser.parse_args()
    for running in args.sizes:
        plan_ns, apply_ns = measure(running, args.steps)
        print(f"running {running:5d}  next_plan    {summary(plan_ns)}")
        print(f"running {running:5d}  apply_result {summary(apply_ns)}")
    if args.profile:
        profile(max(args.sizes), args.steps)


def profile(running: int, steps: int) -> None:
    import cProfile
    import pstats

    sched, worker = fill(running)
    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        plan = sched.next_plan()
        prof.disable()
        assert plan is not None
        result = worker.run(plan)
        prof.enable()
        sched.apply_result(result)
        sched.take_updates()
        prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
