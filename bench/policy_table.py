"""The ordering policies on deep queues (not a test): `python bench/policy_table.py`.

Runs `stepwise simulate` in-process (the real scheduler on the sim worker and its simulated clock)
for each policy on each workload and prints one markdown table (docs/scheduler.md#policy-table):
token hit rate, prompt tokens computed, throughput, TTFT mean/p50/p99, the worst TTFT, and the
waiting queue's depth (max, and mean over simulated time).

Workloads: the Mooncake conversation trace (`--trace PATH`, Mooncake FAST'25, Apache-2.0) at 1x,
1.5x and 2x its load, its first `--limit` requests; and a synthetic burst of requests in a few
hundred prefix groups whose queue passes 1,000 waiting. `lpm (full match)` is LPM matching every
waiting request on every pass with no cutoff: the unbounded optimum the kept matches must reach.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protos.worker import StepResult  # noqa: E402
from stepwise import simulate as sim  # noqa: E402
from stepwise import traces  # noqa: E402

# The simulated worker: 1M KV tokens, 5 ms a step + 30 µs per prompt token computed + 20 ns per token
# of context (about 33k prompt tokens/s when prefilling alone: the conversation trace brings 40k/s).
WORKER = ["--kv-tokens", "8388608", "--max-context", "131072", "--cost", "0.005,0.000025,0.00000002"]
POLICIES: list[tuple[str, list[str]]] = [
    ("fcfs", ["--schedule-policy", "fcfs"]),
    ("lpm (cutoff 128)", ["--schedule-policy", "lpm"]),
    ("lpm (no cutoff)", ["--schedule-policy", "lpm", "--cache-aware-queue-limit", "0"]),
    ("lpm (full match)", ["--schedule-policy", "lpm", "--cache-aware-queue-limit", "0"]),
    (
        "lpm (no cutoff, full dedup)",
        ["--schedule-policy", "lpm", "--cache-aware-queue-limit", "0", "--full-prefix-dedup"],
    ),
    ("dfs-weight", ["--schedule-policy", "dfs-weight"]),
    ("hrrn", ["--schedule-policy", "hrrn"]),
    ("shortest-prefill-first", ["--schedule-policy", "shortest-prefill-first"]),
    ("lpm-aging", ["--schedule-policy", "lpm-aging", "--cache-aware-queue-limit", "0"]),
]
FULL_MATCH = "lpm (full match)"


class DepthSimulation(sim.Simulation):
    """A simulation that also integrates the waiting queue's depth over simulated time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.depth_s = 0.0
        self.max_depth = 0

    def _apply(self, result: StepResult) -> None:
        depth = len(self.scheduler.waiting)
        self.depth_s += depth * result.forward_s
        self.max_depth = max(self.max_depth, depth)
        super()._apply(result)


def full_match(simulation: sim.Simulation) -> None:
    """LPM with no cutoff and no kept matches: every waiting request matched on every pass."""
    sched = simulation.scheduler
    sched.kv.tree.listener = None
    sched.intake.watcher = None
    sched.policy.matcher.kept = None  # type: ignore[attr-defined]


def run(argv: Sequence[str], name: str) -> dict[str, Any]:
    ns = sim.build_parser().parse_args(argv)
    setup = sim.setup_from_args(ns)
    trace = traces.read_trace(ns, setup.limits.vocab_size)
    simulation = DepthSimulation(setup, trace)
    if name == FULL_MATCH:
        full_match(simulation)
    started = time.process_time()
    summary = simulation.run()
    ttft = sorted(
        p.first_token - p.arrival for p in simulation.progress.values() if p.first_token is not None
    )
    clock = simulation.clock
    return {
        "policy": name,
        "requests": summary["requests"],
        "finished": summary["finish_reasons"],
        "hit_rate": summary["hit_rate"],
        "prefill_tokens": simulation.scheduler.queue_clock.prefill_tokens,
        "output_tok_s": summary["output_tokens"] / clock if clock else 0.0,  # type: ignore[operator]
        "simulated_s": clock,
        "ttft_mean_s": summary["ttft_mean_s"],
        "ttft_p50_s": summary["ttft_p50_s"],
        "ttft_p99_s": summary["ttft_p99_s"],
        "ttft_max_s": ttft[-1] if ttft else None,
        "queue_max": simulation.max_depth,
        "queue_mean": simulation.depth_s / clock if clock else 0.0,
        "cpu_s": time.process_time() - started,
    }


def many_groups(path: Path, groups: int, requests: int, seconds: float, seed: int = 0) -> Path:
    """A burst: `requests` arrivals over `seconds`, each in one of `groups` prefix groups (a shared
    1,024-token prefix, 256 tokens of its own, 32 output tokens)."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for i in range(requests):
            line = {
                "rid": f"s{i}",
                "arrival": round(seconds * i / requests, 6),
                "prompt_len": 1280,
                "prefix_group": f"g{rng.randrange(groups)}",
                "prefix_len": 1024,
                "max_new_tokens": 32,
            }
            out.write(json.dumps(line) + "\n")
    return path


def workloads(args: argparse.Namespace, tmp: Path) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    if args.trace is not None:
        base = [str(args.trace), "--trace-format", "mooncake", "--limit", str(args.limit)]
        for load in args.loads:
            out.append((f"conversation {load:g}x, first {args.limit}", [*base, "--load-scale", str(load)]))
    if args.groups:
        synthetic = many_groups(tmp / "groups.jsonl", args.groups, args.synthetic_requests, args.synthetic_s)
        out.append(
            (f"{args.groups} groups, {args.synthetic_requests} in {args.synthetic_s:g} s", [str(synthetic)])
        )
    return out


def cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| workload | policy | hit rate | prompt tokens computed | output tok/s | TTFT mean s | p50 s "
        "| p99 s | worst s | queue max | queue mean |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        figures = [
            cell(r["hit_rate"], ".3f"),
            f"{r['prefill_tokens']:,}",
            cell(r["output_tok_s"], ",.0f"),
            cell(r["ttft_mean_s"], ".2f"),
            cell(r["ttft_p50_s"], ".2f"),
            cell(r["ttft_p99_s"], ".2f"),
            cell(r["ttft_max_s"], ".2f"),
            f"{r['queue_max']:,}",
            cell(r["queue_mean"], ",.0f"),
        ]
        print(f"| {r['workload']} | {r['policy']} | " + " | ".join(figures) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help="the Mooncake conversation trace (JSON lines)")
    parser.add_argument("--limit", type=int, default=1500, help="replay the trace's first N requests")
    parser.add_argument("--loads", type=float, nargs="+", default=[1.0, 1.5, 2.0])
    parser.add_argument(
        "--groups", type=int, default=300, help="synthetic prefix groups (0: no synthetic run)"
    )
    parser.add_argument("--synthetic-requests", type=int, default=4000)
    parser.add_argument("--synthetic-s", type=float, default=20.0, help="the synthetic burst's length")
    parser.add_argument("--policies", nargs="+", help="only these (names as in the table)")
    parser.add_argument("--json", type=Path, help="also append each row to this file as a JSON line")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload, flags in workloads(args, Path(tmp)):
            for name, policy_flags in POLICIES:
                if args.policies and name not in args.policies:
                    continue
                row = {"workload": workload, **run([*flags, *WORKER, *policy_flags], name)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                if args.json is not None:
                    with args.json.open("a") as out:
                        out.write(json.dumps(row) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main()
