"""The capacity table of docs/capacity.md (not a test): `python bench/capacity_table.py TRACE`.

Runs `stepwise simulate --workers N` (the fleet on one simulated clock) on the Mooncake conversation
trace (Mooncake FAST'25, kvcache-ai/Mooncake `FAST25-release/traces/conversation_trace.jsonl`,
Apache-2.0) for each fleet size, load and way of running it, and prints one markdown table:

- cache-aware routing, every worker mixed (the default);
- least-loaded routing (`--routing-policy least-loaded`);
- prefill/decode roles, half the workers each (`--roles p:N/2,d:N/2`), cache-aware;
- cache-aware, mixed, worker 1 killed at the peak: the middle of the busiest minute of arrivals in
  the slice (`--event kill:1@T`, T on the scaled clock).

Every run is the CLI's (`python -m stepwise.cli simulate ...`, printed with `--show-commands`), its
CPU seconds those of the child. `--save PATH` appends each run's row as a JSON line as it ends and
skips the runs already there, so a long table can be made in parts (two processes, two files) and
printed at once with `--print PATH...`.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The GPU-class model (docs/performance.md#step-cost-models: published figures, not measured), an
# H200's memory less Llama-3-8B's weights at 128 KiB a token, and the objectives of the table.
WORKER = ["--cost", "h200-llama3-8b", "--kv-tokens", "800000", "--max-context", "131072"]
SLO = ["--slo-ttft", "2", "--slo-tpot", "0.05"]
WAYS = ("cache-aware", "least-loaded", "pd", "kill")
COLUMNS = (
    "workers | load | way | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | e2e p50 | e2e p99 | hit rate | "
    "both SLOs | goodput | utilisation | moves | handed over | recomputed | steps | sim s | CPU s"
)


def peak_second(trace: Path, limit: int | None, window_s: float = 60.0) -> float:
    """The middle of the busiest `window_s` of arrivals among the first `limit` requests (trace time)."""
    stamps: list[float] = []
    with trace.open() as lines:
        for text in lines:
            if limit is not None and len(stamps) >= limit:
                break
            stamps.append(json.loads(text)["timestamp"] / 1000.0)
    best, best_at, window = 0, 0.0, deque[float]()
    for t in stamps:
        window.append(t)
        while window[0] <= t - window_s:
            window.popleft()
        if len(window) > best:
            best, best_at = len(window), (window[0] + t) / 2
    return best_at


def way_flags(way: str, workers: int, kill_at: float) -> list[str]:
    if way == "least-loaded":
        return ["--routing-policy", "least-loaded"]
    if way == "pd":
        return ["--roles", f"p:{workers // 2},d:{workers - workers // 2}"]
    if way == "kill":
        return ["--event", f"kill:1@{kill_at:.3f}"]
    return []


def command(ns: argparse.Namespace, workers: int, load: float, way: str, kill_at: float) -> list[str]:
    limit = ["--limit", str(ns.limit)] if ns.limit is not None else []
    return [
        sys.executable,
        "-m",
        "stepwise.cli",
        "simulate",
        str(ns.trace),
        "--trace-format",
        "mooncake",
        *limit,
        "--workers",
        str(workers),
        "--load-scale",
        f"{load:g}",
        *WORKER,
        *SLO,
        "--summary-only",
        *way_flags(way, workers, kill_at / load),
    ]


def run(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any], float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    summary = next(x["summary"] for x in lines if "summary" in x)
    fleet = next(x["fleet"] for x in lines if "fleet" in x)
    return summary, fleet, cpu


def row(workers: int, load: float, way: str, summary: dict, fleet: dict, cpu: float) -> dict[str, Any]:
    use = [w["utilisation"] for w in fleet["per_worker"]]
    return {
        "workers": workers,
        "load": load,
        "way": way,
        "ttft_p50": fleet["ttft_s"]["p50"],
        "ttft_p99": fleet["ttft_s"]["p99"],
        "tpot_p50": fleet["tpot_s"]["p50"],
        "tpot_p99": fleet["tpot_s"]["p99"],
        "e2e_p50": fleet["e2e_s"]["p50"],
        "e2e_p99": fleet["e2e_s"]["p99"],
        "hit_rate": summary["hit_rate"],
        "both": fleet["slo"]["both_attained"],
        "goodput": fleet["slo"]["goodput_rps"],
        "use": (min(use), max(use)),
        "moves": sum(fleet["migrations"].values()),
        "handed_over": fleet["handed_over"],
        "recomputed": fleet["recomputed_tokens"],
        "requests": summary["requests"],
        "finish": summary["finish_reasons"],
        "steps": summary["steps"],
        "simulated_s": summary["simulated_s"],
        "cpu_s": round(cpu, 1),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    names = {"cache-aware": "cache-aware, mixed", "least-loaded": "least-loaded, mixed"}
    out = ["| " + COLUMNS + " |", "|" + " ---: |" * 2 + " --- |" + " ---: |" * 9 + " --- |" + " ---: |" * 6]
    order = {w: i for i, w in enumerate(WAYS)}
    for r in sorted(rows, key=lambda r: (r["workers"], r["load"], order[r["way"]])):
        n = r["workers"]
        way = names.get(r["way"], r["way"])
        if r["way"] == "pd":
            way = f"cache-aware, {n // 2} prefill + {n - n // 2} decode"
        elif r["way"] == "kill":
            way = "cache-aware, worker 1 killed at the peak"
        cells = [
            str(n),
            f"{r['load']:g}x",
            way,
            f"{r['ttft_p50']:.3f}",
            f"{r['ttft_p99']:.3f}",
            f"{r['tpot_p50'] * 1e3:.1f}",
            f"{r['tpot_p99'] * 1e3:.1f}",
            f"{r['e2e_p50']:.2f}",
            f"{r['e2e_p99']:.2f}",
            f"{r['hit_rate']:.3f}",
            f"{r['both']:.3f}",
            f"{r['goodput']:.2f}",
            f"{r['use'][0]:.2f}-{r['use'][1]:.2f}",
            str(r["moves"]),
            str(r["handed_over"]),
            f"{r['recomputed']:,}",
            f"{r['steps']:,}",
            f"{r['simulated_s']:.0f}",
            f"{r['cpu_s']:.0f}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path, nargs="?", help="mooncake_conversation.jsonl")
    parser.add_argument("--limit", type=int, default=None, help="the trace's first N requests (default: all)")
    parser.add_argument("--workers", default="8,16,32", help="fleet sizes, comma-separated")
    parser.add_argument("--loads", default="1,2", help="load scales, comma-separated")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"of {', '.join(WAYS)}")
    parser.add_argument("--save", type=Path, default=None, help="append each run's row here (JSON lines)")
    parser.add_argument("--print", type=Path, nargs="+", default=None, help="print the table of saved rows")
    parser.add_argument("--show-commands", action="store_true", help="print each command before it runs")
    ns = parser.parse_args()
    if ns.print:
        rows = [json.loads(line) for path in ns.print for line in path.read_text().splitlines() if line]
        print(markdown(rows))
        return 0
    if ns.trace is None:
        parser.error("a trace is needed (or --print)")
    kill_at = peak_second(ns.trace, ns.limit)
    done = set()
    if ns.save is not None and ns.save.exists():
        saved = map(json.loads, ns.save.read_text().splitlines())
        done = {(r["workers"], r["load"], r["way"]) for r in saved}
    rows = []
    for workers in (int(w) for w in ns.workers.split(",")):
        for load in (float(x) for x in ns.loads.split(",")):
            for way in ns.ways.split(","):
                if (workers, load, way) in done:
                    continue
                argv = command(ns, workers, load, way, kill_at)
                if ns.show_commands:
                    print(shlex.join(argv[1:]), file=sys.stderr, flush=True)
                rows.append(row(workers, load, way, *run(argv)))
                if ns.save is not None:
                    with ns.save.open("a") as out:
                        out.write(json.dumps(rows[-1]) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
