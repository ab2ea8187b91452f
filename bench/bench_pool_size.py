"""What the KV pool's size costs the control plane (not a test): `python bench/bench_pool_size.py`.

For each capacity and page size: the time and traced memory (tracemalloc peak) of building a Scheduler
for a worker that claims that capacity, then, with ~200k tokens cached in the tree, the time of the
one-shot idle integrity check (`check_pool_invariants`) and the longest slice of `PoolCheck.run(4096)`,
which is how long the idle check blocks the event loop at a time.

Runs on code without PoolCheck too (its columns read n/a), so the same script gives before and after
figures; 10^9 is only measured where the allocator is lazy (the old one would allocate ~9 GB).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from control_plane.cache.invariants import check_pool_invariants
from control_plane.config import SchedulerConfig
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import WorkerLimits

try:
    from control_plane.cache.invariants import PoolCheck
except ImportError:  # code from before the sliced check
    PoolCheck = None  # type: ignore[assignment,misc]

MIB = 2**20
SYSTEM_PROMPTS = 8
SYSTEM_LEN = 512
VOCAB = 50_000


def build_scheduler(capacity: int, page_size: int, max_context: int) -> tuple[Scheduler, float, int]:
    """A Scheduler for a worker that claims `capacity` KV tokens: (it, seconds, traced peak bytes)."""
    limits = WorkerLimits(
        worker_id="bench",
        kv_capacity_tokens=capacity,
        page_size=page_size,
        max_context=max_context,
        vocab_size=VOCAB,
        eos_token_ids=frozenset({2}),
    )
    gc.collect()
    tracemalloc.start()
    start = time.perf_counter()
    sched = Scheduler(SchedulerConfig(), limits)
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return sched, elapsed, peak


def fill_cache(sched: Scheduler, tokens: int, seed: int = 0) -> None:
    """Cache about `tokens` tokens: conversations under a few shared system prompts, as finished requests
    leave them (duplicates of cached pages and unaligned tails go back to the free list)."""
    alloc, tree, page = sched.kv.allocator, sched.kv.tree, sched.page_size
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, size=SYSTEM_LEN) for _ in range(SYSTEM_PROMPTS)]
    while tree.total_size() < tokens:
        tail = rng.integers(0, VOCAB, size=int(rng.integers(16, 600)))
        ids = np.concatenate((systems[int(rng.integers(SYSTEM_PROMPTS))], tail))
        aligned = len(ids) - len(ids) % page
        slots = alloc.alloc_extend(0, -1, len(ids))
        assert slots is not None, "pool too small for the cached tokens"
        cached = tree.insert(ids[:aligned], slots[:aligned])
        if cached:
            alloc.free(slots[:cached])
        if aligned < len(ids):
            alloc.free(slots[aligned:])


def time_one_shot(sched: Scheduler) -> float:
    start = time.perf_counter()
    check_pool_invariants(sched.kv.allocator, sched.kv.tree, sched.private_slots())
    return time.perf_counter() - start


def time_slices(sched: Scheduler, budget: int) -> tuple[int, float, float] | None:
    """(slices, longest, total seconds) of one PoolCheck run to completion; None without PoolCheck."""
    if PoolCheck is None:
        return None
    check = PoolCheck(sched.kv.allocator, sched.kv.tree, sched.private_slots())
    times = []
    done = False
    while not done:
        start = time.perf_counter()
        done = check.run(budget)
        times.append(time.perf_counter() - start)
    return len(times), max(times), sum(times)


def measure(capacity: int, page_size: int, ns: argparse.Namespace) -> str:
    sched, built_s, peak = build_scheduler(capacity, page_size, ns.max_context)
    fill_cache(sched, ns.cached)
    one_shot = time_one_shot(sched) if capacity <= ns.one_shot_max else None
    sliced = time_slices(sched, ns.budget)
    row = f"{capacity:>13,} {page_size:>4} {built_s * 1e3:10.1f} {peak / MIB:10.1f}"
    row += f" {one_shot * 1e3:12.1f}" if one_shot is not None else f" {'skipped':>12}"
    if sliced is None:
        return row + f" {'n/a':>7} {'n/a':>10} {'n/a':>10}"
    slices, longest, total = sliced
    return row + f" {slices:>7} {longest * 1e3:10.2f} {total * 1e3:10.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacities", type=float, nargs="+", default=[1e6, 1e7, 1e8, 1e9])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--cached", type=int, default=200_000, help="tokens to cache before the checks")
    parser.add_argument("--budget", type=int, default=4096, help="PoolCheck.run budget per slice")
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument(
        "--one-shot-max", type=float, default=1e10, help="skip the one-shot check above this capacity"
    )
    ns = parser.parse_args()
    lazy = PoolCheck is not None
    print(f"{'capacity':>13} {'page':>4} {'build ms':>10} {'peak MiB':>10} {'one-shot ms':>12}", end="")
    print(f" {'slices':>7} {'max ms':>10} {'sum ms':>10}   (PoolCheck.run({ns.budget}))")
    for capacity in (int(c) for c in ns.capacities):
        for page_size in ns.page_sizes:
            if capacity >= 10**9 and not lazy:
                print(f"{capacity:>13,} {page_size:>4}  skipped: the eager allocator would need ~9 GB")
                continue
            print(measure(capacity, page_size, ns), flush=True)


if __name__ == "__main__":
    main()
