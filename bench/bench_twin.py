"""The simulator against live, one worker (not a test): `python bench/bench_twin.py`
(docs/performance.md#the-simulator-against-live).

Two traces of the same shape (seeds differ): a fit trace and an evaluation trace. Each is sent live by
`stepwise bench --dataset trace` to a fresh `stepwise up --model M --record DIR` (one worker). Cost
models are fitted on the fit run's recording (`stepwise simulate --fit-cost`, by forward and with
`--fit-interval` by step interval), and the evaluation trace is simulated with them (arrivals by
time, the scheduler and worker limits of the evaluation run's header): the twin's error is the
simulation's TTFT p50/p99 and end-to-end p50 against the live run's. The rows:

- the forwards fitted on the other run: the simulated clock counts the worker's forwards only;
- the intervals fitted on the other run: each step also counts the control plane's turn between
  steps (the worker's wait for its next plan), as the recording measured it;
- the same, calibrated on the fit run's clients (see `calibrated`): a per-step term for what the
  worker's own measures miss, and a per-request term for the client's path to the scheduler and
  back, which no recording times;
- the evaluation run's own steps with its arrival stamps (the same plans as live,
  tests/record/test_twin_live.py), timed by their forwards and by their intervals: what is left
  is time outside the worker's steps.

The last row sets the fit run's live figures against the evaluation run's: two live runs of traces of
one shape, the machine's own run-to-run spread.

Live TTFT and latency are the client's (bench's), simulated ones the simulated clock's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clients import traces as client_traces  # noqa: E402
from control_plane.record.entries import ApplyResult, Header, NextPlan  # noqa: E402
from control_plane.record.files import read_entries, read_header  # noqa: E402
from stepwise import costs, twin_recorded  # noqa: E402
from stepwise import simulate as sim  # noqa: E402
from stepwise.up import stop_processes  # noqa: E402
from tests.processes import ready_file_sync  # noqa: E402

CLI = [sys.executable, "-m", "stepwise.cli"]
METRICS = (("ttft p50", "ttft_median_ms", "ttft_p50_s"), ("ttft p99", "ttft_p99_ms", "ttft_p99_s"))
METRICS += (("e2e p50", "e2e_latency_median_ms", "latency_p50_s"),)


def make_trace(
    path: Path, n: int, rate: float, prompt: tuple[int, int], output: tuple[int, int], seed: int
) -> Path:
    """n requests, Poisson arrivals at `rate`/s, prompt and output lengths uniform in the ranges; a
    quarter share a 64-token system prompt (so the prefix cache plays its part)."""
    rng = random.Random(seed)
    clock, lines = 0.0, []
    for i in range(n):
        line: dict[str, Any] = {"rid": f"s{seed}-{i}", "arrival": round(clock, 6)}
        line |= {"prompt_len": rng.randint(*prompt), "max_new_tokens": rng.randint(*output)}
        if i % 4 == 0:
            line |= {"prefix_group": "sys", "prefix_len": 64}
        lines.append(json.dumps(line))
        clock += rng.expovariate(rate)
    path.write_text("\n".join(lines) + "\n")
    return path


def live_run(model: str, trace: Path, record: Path, work: Path) -> dict[str, Any]:
    """`stepwise up --model M --record DIR`, the trace sent by `stepwise bench`; bench's JSON report."""
    ready = work / f"ready-{record.name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWISE_")} | {"OMP_NUM_THREADS": "1"}
    up = [*CLI, "up", "--model", model, "--host", "127.0.0.1", "--port", "0", "--worker-port", "0"]
    up += ["--log-level", "warning", "--record", str(record), "--ready-file", str(ready)]
    proc = subprocess.Popen(up, cwd=ROOT, env=env)
    try:
        address = ready_file_sync(ready, proc, 300, "stepwise up")["address"]
        vocab = str(read_header(record).limits.vocab_size)
        bench = [
            *CLI,
            "bench",
            "--address",
            address,
            "--dataset",
            "trace",
            str(trace),
            "--vocab",
            vocab,
            "--json",
            "--output-file",
            str(work / f"live-{record.name}.json"),
        ]
        out = subprocess.run(
            bench, cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=1800
        )
        return json.loads(out.stdout)  # type: ignore[no-any-return]
    finally:
        stop_processes([proc], timeout=30, sig=signal.SIGTERM)


def fit(records: list[Path], out: Path, *flags: str) -> Path:
    """`stepwise simulate --fit-cost ... --json`, written where `--cost FILE` reads it."""
    args = [*CLI, "simulate", "--fit-cost", *map(str, records), "--json", *flags]
    out.write_text(subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    return out


def simulate(
    trace: Path,
    header: Header,
    cost: str,
    arrivals_of: Path | None = None,
    seconds: dict[int, float] | None = None,
) -> dict[str, Any]:
    """The trace simulated on `cost` (or these step seconds); arriving by time, or at the steps
    `arrivals_of` stamped."""
    recorded = costs.recorded_seconds(cost) if seconds is None else seconds
    model = costs.parse_cost(cost) if recorded is None else sim.CostModel()
    setup = sim.SimSetup(header.scheduler, header.limits, model, recorded_seconds=recorded)
    requests = [sim.to_request(e) for e in client_traces.load_trace(trace, header.limits.vocab_size)]
    if arrivals_of is None:
        return sim.Simulation(setup, requests).run()
    recorded = twin_recorded.read_worker(arrivals_of)
    return sim.Simulation(
        setup, requests, arrival_steps=recorded.arrivals, after_idle=recorded.after_idle
    ).run()


def per_request(trace: Path, header: Header, cost: str) -> dict[str, tuple[float, float, int]]:
    """rid -> (TTFT, end to end, output tokens) of the trace simulated on `cost`."""
    setup = sim.SimSetup(header.scheduler, header.limits, costs.parse_cost(cost))
    requests = [sim.to_request(e) for e in client_traces.load_trace(trace, header.limits.vocab_size)]
    simulation = sim.Simulation(setup, requests)
    simulation.run()
    return {
        rid: (p.first_token - p.arrival, p.finished - p.arrival, p.output_tokens)
        for rid, p in simulation.progress.items()
        if p.first_token is not None and p.finished is not None
    }


def live_requests(work: Path, name: str) -> dict[str, tuple[float, float]]:
    records = json.loads((work / f"live-rec-{name}.json").read_text())["requests"]
    return {r["rid"]: (r["ttft_s"], r["latency_s"]) for r in records if r["status"] == "OK"}


def calibrated(work: Path, traces: dict[str, Path], header: Header, cost: Path) -> dict[str, Any]:
    """The evaluation trace simulated on the interval model `cost` calibrated on the fit run's live
    requests: first each step lengthened by the median time a fit-run request took per further token
    beyond its simulation (what the worker's measures miss: the hand-off of each forward to its
    thread and back), then each request's TTFT and end to end lengthened by the median time a fit-run
    request took before its first token beyond its simulation on that model (the client's path to
    the scheduler and back)."""
    fit_live = live_requests(work, "fit")
    fit_sim = per_request(traces["fit"], header, str(cost))
    step = statistics.median(
        ((fit_live[rid][1] - fit_live[rid][0]) - (fit_sim[rid][1] - fit_sim[rid][0])) / (fit_sim[rid][2] - 1)
        for rid in fit_live
        if fit_sim[rid][2] > 1
    )
    model = costs.parse_cost(str(cost))
    model = dataclasses.replace(model, a=float(f"{max(0.0, model.a + step):.4g}"))
    fit_sim = per_request(traces["fit"], header, model.spec())
    path = statistics.median(fit_live[rid][0] - fit_sim[rid][0] for rid in fit_live)
    print(f"calibrated on the fit run: {step * 1000:+.3f} ms a step, {path * 1000:+.2f} ms a request", end="")
    print(f" (--cost {model.spec()})")
    runs = per_request(traces["eval"], header, model.spec()).values()
    ttft = [t + path for t, _, _ in runs]
    e2e = [e + path for _, e, _ in runs]
    return {
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "latency_p50_s": float(np.percentile(e2e, 50)),
    }


def recorded_intervals(record: Path) -> dict[int, float]:
    """step id -> its interval on the worker as --fit-interval counts it: its forward, plus the next
    result's wait unless the control plane went idle before the next plan."""
    results, after_idle, idle = [], set(), False
    for entry in read_entries(record):
        if isinstance(entry, NextPlan):
            if entry.plan is not None and idle:
                after_idle.add(entry.plan.step_id)
            idle = entry.plan is None
        elif isinstance(entry, ApplyResult):
            results.append(entry.result)
    waits = {r.step_id: r.wait_s for r in results}
    return {
        r.step_id: r.forward_s + (0.0 if r.step_id + 1 in after_idle else waits.get(r.step_id + 1, 0.0))
        for r in results
    }


def errors(live: dict[str, Any], simulated: dict[str, Any]) -> dict[str, str]:
    row = {}
    for name, live_key, sim_key in METRICS:
        measured, predicted = live[live_key] / 1000, simulated[sim_key]
        row[name] = (
            f"{measured * 1000:.1f} / {predicted * 1000:.1f} ms ({(predicted - measured) / measured:+.0%})"
        )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="the model `stepwise up --model` serves")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--rate", type=float, default=12.0, help="arrivals per second")
    parser.add_argument("--prompt-len", default="16,256")
    parser.add_argument("--output-len", default="8,64")
    parser.add_argument("--work", type=Path, default=None, help="keep traces and recordings here")
    parser.add_argument("--reuse", action="store_true", help="the live runs already in --work, not new ones")
    ns = parser.parse_args()
    prompt = tuple(map(int, ns.prompt_len.split(",")))
    output = tuple(map(int, ns.output_len.split(",")))
    work = ns.work or Path(tempfile.mkdtemp(prefix="twin-"))
    work.mkdir(parents=True, exist_ok=True)
    traces = {name: make_trace(work / f"{name}.jsonl", ns.requests, ns.rate, prompt, output, seed)  # type: ignore[arg-type]
              for name, seed in (("fit", 1), ("eval", 2))}  # fmt: skip
    live = {
        name: live_run(ns.model, trace, work / f"rec-{name}", work)
        if not (ns.reuse and (work / f"live-rec-{name}.json").exists())
        else json.loads((work / f"live-rec-{name}.json").read_text())["report"]
        for name, trace in traces.items()
    }
    header = read_header(work / "rec-eval")
    fitted = fit([work / "rec-fit"], work / "cost-fit.json")
    intervals = fit([work / "rec-fit"], work / "cost-fit-interval.json", "--fit-interval")
    rows = {
        "forwards fitted on the other run": simulate(traces["eval"], header, str(fitted)),
        "intervals fitted on the other run": simulate(traces["eval"], header, str(intervals)),
        "intervals fitted on the other run, calibrated on its clients": calibrated(
            work, traces, header, intervals
        ),
        "this run's own forwards, its arrival steps": simulate(
            traces["eval"], header, f"recorded:{work / 'rec-eval'}", work / "rec-eval"
        ),
        "this run's own intervals, its arrival steps": simulate(
            traces["eval"], header, "", work / "rec-eval", recorded_intervals(work / "rec-eval")
        ),
    }
    print(f"model {ns.model}, {ns.requests} requests at {ns.rate}/s, prompts {ns.prompt_len}, ", end="")
    print(f"outputs {ns.output_len}; work in {work}")
    for name, report in live.items():
        keys = ("duration_s", "ttft_median_ms", "ttft_p99_ms", "e2e_latency_median_ms")
        print(f"live {name} run: {json.dumps({k: report[k] for k in keys})}")
    print(f"forwards fitted on the other run: {json.loads(fitted.read_text())['cost']}")
    print(f"intervals fitted on the other run: {json.loads(intervals.read_text())['cost']}")
    print("| simulated with | TTFT p50 live / sim | TTFT p99 live / sim | e2e p50 live / sim |")
    print("| --- | --- | --- | --- |")
    fit_live = {
        "ttft_p50_s": live["fit"]["ttft_median_ms"] / 1000,
        "ttft_p99_s": live["fit"]["ttft_p99_ms"] / 1000,
    }
    fit_live["latency_p50_s"] = live["fit"]["e2e_latency_median_ms"] / 1000
    rows["(the fit run's live figures: another trace of the same shape)"] = fit_live
    for name, summary in rows.items():
        cells = errors(live["eval"], summary)
        print(f"| {name} | {cells['ttft p50']} | {cells['ttft p99']} | {cells['e2e p50']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
