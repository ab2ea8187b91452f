"""Benchmark of the scheduler's per-step cost (not a test): `python bench/bench_scheduler.py`.

Steady decode at 256, 1024 and 4096 running requests on a pool large enough that nothing is
retracted (and, with `--churn`, requests that finish after 16–64 tokens and are replaced at once).
It times `next_plan`, `apply_result` and `take_updates` of each step and their sum, and the time the
garbage collector ran inside those calls (gc.callbacks), in two modes: without overlap (each result
applied before the next plan) and with overlap (plan N+1 made before result N is applied).

The worker is a vectorised stand-in (lengths per handle, a token per sampled sequence, the KV report)
whose own time is not counted. `--baseline DIR` also runs this script against another checkout (e.g.
`git worktree add /tmp/base HEAD`) in a subprocess and prints both side by side; a checkout from
before overlap scheduling and columnar results is measured without overlap only.
Goal: next_plan + apply_result + take_updates p50 ≤ 0.5 ms at 1024 running, ≤ 2 ms at 4096.

`--ordering` measures one LPM ordering pass instead (docs/scheduler.md#kept-matches), at 4096
waiting requests by default, in prefix groups, while the tree changes between passes as under load
(a few admitted requests' prompts inserted, a few new arrivals, some eviction). CPU time of
`policy.order` alone, per pass: `kept` is `--cache-aware-queue-limit 0` (kept matches), `full` is
what the cutoff avoids (every request matched on every pass, SGLang's pass without its fallback),
`cutoff` is the default (past 128 the pass reorders nothing). Goal: kept ≤ 0.5 ms at 4096.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN = 32
# Room for 4096 requests of 32 + 1000 tokens: admission (which reserves their future decode) takes
# everyone at once and nothing is ever retracted.
CAPACITY = 1 << 22
MAX_NEW = 1000
CALLS = ("next_plan", "apply_result", "take_updates")


def _root_from_argv() -> Path:
    if "--root" in sys.argv:
        return Path(sys.argv[sys.argv.index("--root") + 1]).resolve()
    return ROOT


sys.path.insert(0, str(_root_from_argv()))

from control_plane.request import Request  # noqa: E402
from control_plane.scheduler.scheduler import Scheduler  # noqa: E402
from protos.worker import KvReport, StepPlan, StepResult  # noqa: E402
from tests.control_plane.factories import make_scheduler, params, prompt  # noqa: E402

# A checkout from before columnar results: results name handles, updates are a list, no overlap.
OLD_API = "handles" in StepResult.__dataclass_fields__


class BenchWorker:
    """Executes plans as bookkeeping only: per-handle lengths in an array, one token per sampled
    sequence (a function of handle and position), and the KV report the scheduler expects."""

    def __init__(self) -> None:
        self.lengths = np.zeros(1 << 12, dtype=np.int64)
        self.live = np.zeros(1 << 12, dtype=bool)

    def run(self, plan: StepPlan) -> StepResult:
        self.live[plan.releases] = False
        for seq in plan.new_seqs:
            self._grow(seq.handle)
            self.live[seq.handle] = True
            self.lengths[seq.handle] = len(seq.prefix_slots)
        ext, dec = plan.extends, plan.decodes
        self.lengths[ext.handles] += ext.lens
        self.lengths[dec.handles] += 1
        sampled = np.concatenate((ext.handles[ext.sample], dec.handles))
        tokens = (10 + (sampled * 7919 + self.lengths[sampled]) % 900).astype(np.int32)
        kv = KvReport(int(self.live.sum()), int(self.lengths[self.live].sum()), CAPACITY)
        if OLD_API:
            return StepResult(plan.step_id, handles=sampled, token_ids=tokens, kv=kv)  # type: ignore[call-arg]
        return StepResult(plan.step_id, token_ids=tokens, kv=kv)

    def _grow(self, handle: int) -> None:
        if handle >= len(self.lengths):
            size = max(2 * len(self.lengths), handle + 1)
            self.lengths = np.resize(self.lengths, size)
            self.live = np.concatenate((self.live, np.zeros(size - len(self.live), dtype=bool)))


class GcTimer:
    """Time spent in collections while `on` (gc.callbacks), and how many ran."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0
        self.collections = 0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.on:
            self.seconds += time.perf_counter() - self._start
            self.collections += 1


class Driver:
    """One scheduler and its worker; `step` runs one step and returns each call's nanoseconds."""

    def __init__(self, running: int, overlap: bool, churn: bool, seed: int = 0) -> None:
        self.sched: Scheduler = make_scheduler(
            capacity=CAPACITY, max_context=2048, max_running_requests=running
        )
        self.worker = BenchWorker()
        self.overlap = overlap
        self.churn = churn
        self.kept = self.sched.policy.matcher.kept  # type: ignore[attr-defined]
        self.rng = random.Random(seed)
        self.in_flight: deque[StepResult] = deque()
        self.added = 0
        self.finished = 0
        for _ in range(running):
            self._add()

    def _add(self) -> None:
        i = self.added
        self.added += 1
        max_new = self.rng.randint(16, 64) if self.churn else MAX_NEW
        p = params(max_new, ignore_eos=True)
        if OLD_API:
            self.sched.add_request(f"r{i}", prompt(PROMPT_LEN, seed=i), p)
        else:
            self.sched.add_request(f"r{i}", prompt(PROMPT_LEN, seed=i), p, uid=i + 1)

    def step(self, timer: GcTimer) -> dict[str, int]:
        sched = self.sched
        ns = dict.fromkeys(CALLS, 0)
        plan = _timed(timer, ns, "next_plan", sched.next_plan)
        if plan is not None:
            self.in_flight.append(self.worker.run(plan))
        if self.in_flight and (not self.overlap or len(self.in_flight) == 2 or plan is None):
            result = self.in_flight.popleft()
            _timed(timer, ns, "apply_result", lambda: sched.apply_result(result))
        self._replace(_timed(timer, ns, "take_updates", sched.take_updates))
        return ns

    def _replace(self, updates: Any) -> None:
        ended = [u for u in updates if u.finished is not None] if OLD_API else updates.finished
        self.finished += len(ended)
        if self.churn:
            for _ in ended:
                self._add()

    def fill(self) -> None:
        """Admit and prefill everyone; a few decode steps after (the first merges the batch)."""
        timer = GcTimer()
        while self.sched.waiting or self.sched.chunked_req is not None:
            self.step(timer)
        for _ in range(5):
            self.step(timer)


def _timed(timer: GcTimer, ns: dict[str, int], name: str, call: Any) -> Any:
    timer.on = True
    start = time.perf_counter_ns()
    out = call()
    ns[name] = time.perf_counter_ns() - start
    timer.on = False
    return out


def measure(running: int, steps: int, overlap: bool, churn: bool) -> dict[str, Any]:
    driver = Driver(running, overlap, churn)
    driver.fill()
    timer = GcTimer()
    gc.callbacks.append(timer)
    samples: dict[str, list[int]] = {name: [] for name in CALLS}
    try:
        for _ in range(steps):
            for name, ns in driver.step(timer).items():
                samples[name].append(ns)
    finally:
        gc.callbacks.remove(timer)
    if not churn:
        assert driver.finished == 0 and driver.sched.num_retracted_total == 0
    total = [sum(parts) for parts in zip(*samples.values(), strict=True)]
    stats = {name: _percentiles(values) for name, values in (*samples.items(), ("sum", total))}
    return {
        "running": running,
        "overlap": overlap,
        "churn": churn,
        "steps": steps,
        **stats,
        "gc_ms_per_step": 1e3 * timer.seconds / steps,
        "gc_collections": timer.collections,
    }


def _percentiles(ns: list[int]) -> dict[str, float]:
    ms = np.asarray(ns) / 1e6
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    modes = [False] if OLD_API else [False, True]
    return [measure(running, args.steps, overlap, args.churn) for running in args.sizes for overlap in modes]


def baseline_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    command = [sys.executable, __file__, "--root", str(args.baseline), "--json", "--steps", str(args.steps)]
    command += ["--sizes", *map(str, args.sizes)] + (["--churn"] if args.churn else [])
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=args.baseline)
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def print_table(rows: list[tuple[str, dict[str, Any]]]) -> None:
    header = f"{'code':9} {'running':>7} {'overlap':>7} " + " ".join(f"{c:>19}" for c in (*CALLS, "sum"))
    print(header + f" {'gc ms/step':>10} {'gcs':>5}")
    print(" " * 25 + " ".join(f"{'p50':>9} {'p99':>9}" for _ in range(4)) + "   (ms)")
    for label, row in rows:
        cells = " ".join(f"{row[c]['p50']:9.3f} {row[c]['p99']:9.3f}" for c in (*CALLS, "sum"))
        overlap = "yes" if row["overlap"] else "no"
        gc_ms, gcs = row["gc_ms_per_step"], row["gc_collections"]
        print(f"{label:9} {row['running']:7d} {overlap:>7} {cells} {gc_ms:10.3f} {gcs:5d}")


ORDERING_VARIANTS = ("kept", "full", "cutoff")


class OrderingDriver:
    """A waiting queue of `depth` requests in `groups` prefix groups and a tree that changes between
    passes, for one variant; the same seed gives every variant the same sequence of changes."""

    def __init__(self, variant: str, depth: int, groups: int, seed: int = 0) -> None:
        limit = {"kept": 0, "full": 0, "cutoff": 128}[variant]
        self.sched = make_scheduler(
            capacity=1 << 22, max_context=4096, schedule_policy="lpm", cache_aware_queue_limit=limit
        )
        if variant == "full":  # the same policy with no kept matches: every pass matches everyone
            self.sched.kv.tree.listener = None
            self.sched.policy.matcher.kept = None  # type: ignore[attr-defined]
        self.kept = self.sched.policy.matcher.kept  # type: ignore[attr-defined]
        self.rng = random.Random(seed)
        self.prefixes = [prompt(512, 10_000 + g) for g in range(groups)]
        self.queue: list[Request] = []
        self.count = 0
        for _ in range(depth):
            self._arrive()
        for g in range(0, groups, 2):  # half the groups cached at the start
            self._compute(self.prefixes[g])

    def _arrive(self) -> None:
        self.count += 1
        group = self.rng.randrange(len(self.prefixes))
        ids = self.prefixes[group] + prompt(128, self.count)
        req = Request(rid=f"r{self.count}", origin_input_ids=ids, params=params(16))
        req.wait_queue_entry_time = self.count
        self.queue.append(req)
        if self.kept is not None:  # as the scheduler's Intake tells it
            self.kept.joined(req)

    def _compute(self, ids: list[int]) -> None:
        kv = self.sched.kv
        kv.evict_for(len(ids))
        slots = kv.allocator.alloc(len(ids))
        assert slots is not None
        cached = kv.tree.insert(ids, slots)
        kv.allocator.free(slots[:cached])

    def churn(self) -> None:
        """Between passes: the first 8 are admitted (their prompts go into the tree), 8 arrive, and
        now and then some of the tree is evicted."""
        for req in self.queue[:8]:
            if self.kept is not None:
                self.kept.left(req)
            self._compute(list(req.origin_input_ids))
        del self.queue[:8]
        for _ in range(8):
            self._arrive()
        if self.rng.random() < 0.2:
            self.sched.kv.tree.evict(4096)

    def order(self) -> int:
        started = time.process_time_ns()
        self.sched.policy.order(self.queue, [])
        return time.process_time_ns() - started


def measure_ordering(variant: str, depth: int, passes: int, groups: int) -> dict[str, Any]:
    driver = OrderingDriver(variant, depth, groups)
    driver.order()  # the first pass matches everyone in every variant but the cutoff
    driver.churn()
    ns: list[int] = []
    for _ in range(passes):
        ns.append(driver.order())
        driver.churn()
    kept = driver.sched.policy.matcher.kept  # type: ignore[attr-defined]
    ms = np.asarray(ns) / 1e6
    return {
        "variant": variant,
        "depth": depth,
        "groups": groups,
        "passes": passes,
        "p50_ms": float(np.percentile(ms, 50)),
        "mean_ms": float(ms.mean()),
        "p99_ms": float(np.percentile(ms, 99)),
        "rematches_per_pass": (kept.rematches - depth) / passes if kept is not None else None,
    }


def ordering_main(args: argparse.Namespace) -> None:
    rows = [
        measure_ordering(v, depth, args.passes, args.groups) for depth in args.depths for v in args.variants
    ]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"one LPM ordering pass; {args.passes} passes per row; {args.groups} prefix groups; CPU ms")
    print(f"{'variant':8} {'waiting':>7} {'p50':>8} {'mean':>8} {'p99':>8} {'matches/pass':>12}")
    for r in rows:
        again = "" if r["rematches_per_pass"] is None else f"{r['rematches_per_pass']:.1f}"
        figures = f"{r['p50_ms']:8.3f} {r['mean_ms']:8.3f} {r['p99_ms']:8.3f}"
        print(f"{r['variant']:8} {r['depth']:7d} {figures} {again:>12}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ordering", action="store_true", help="time one LPM ordering pass instead")
    parser.add_argument("--depths", type=int, nargs="+", default=[4096], help="--ordering: waiting requests")
    parser.add_argument("--passes", type=int, default=200, help="--ordering: passes measured per row")
    parser.add_argument("--groups", type=int, default=256, help="--ordering: prefix groups")
    parser.add_argument(
        "--variants", nargs="+", default=list(ORDERING_VARIANTS), choices=ORDERING_VARIANTS, help="--ordering"
    )
    parser.add_argument("--steps", type=int, default=200, help="steps measured per size and mode")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--churn", action="store_true", help="requests finish after 16-64 tokens, replaced")
    parser.add_argument("--baseline", type=Path, help="another checkout to measure side by side")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose scheduler is measured")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON line")
    parser.add_argument("--profile", action="store_true", help="cProfile the largest size (overlap)")
    args = parser.parse_args()
    if args.ordering:
        ordering_main(args)
        return
    if args.profile:
        profile(max(args.sizes), args.steps, args.churn)
        return
    rows = run_all(args)
    if args.json:
        print(json.dumps(rows))
        return
    labelled = [("new", row) for row in rows]
    if args.baseline is not None:
        old = baseline_rows(args)
        labelled = [("baseline", r) for r in old] + labelled
        labelled.sort(key=lambda lr: (lr[1]["running"], lr[0] != "baseline", lr[1]["overlap"]))
    mode = "churn (16-64 tokens each, replaced)" if args.churn else "steady decode"
    print(f"{mode}; {args.steps} steps per row; worker time not counted")
    print_table(labelled)


def profile(running: int, steps: int, churn: bool) -> None:
    import cProfile
    import pstats

    driver = Driver(running, overlap=not OLD_API, churn=churn)
    driver.fill()
    timer = GcTimer()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        driver.step(timer)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
