"""The simulator against live, one worker (not a test): `python bench/bench_twin.py`
(docs/performance.md#the-simulator-against-live).

Two traces of the same shape (seeds differ): a fit trace and an evaluation trace. Each is sent live by
`stepwise bench --dataset trace` to a fresh `stepwise up --model M --record DIR` (one worker). Cost
models are fitted on the fit run's recording (`stepwise simulate --fit-cost`, by forward and with
`--fit-interval` by step interval), and the evaluation trace is simulated with them (arrivals by
time, the scheduler and worker limits of the evaluation run's header): the twin's error is the
simulation's TTFT p50/p99 and end-to-end p50 against the live run's. The rows:

- the forwards fitted on the other run: the simulated clock counts the worker's forwards only;
- the spans fitted on the other run (`--fit-interval` on a stamped recording): each step also
  counts the control plane's turn between steps and the hand-off of each plan to the worker's
  forward and of its result back, as the recording's stamps measured them;
- the same with the client path fitted on the other run's recording (`arrive_s`, `publish_s`:
  docs/debugging.md#step-cost-models): the twin as `stepwise simulate --cost FIT.json` runs it,
  everything taken from the fit run's recording;
- the same with `--cost-jitter`: each step adds a draw from the fit's residuals (its steps'
  measured less modelled spans), so the stalls of the fit run reach the simulated tail;
- the same plus the client's legs measured on the fit run (`client_legs`: its client's end to end
  less its control plane's, request by request, from the recording's stamps), which no recording
  can hold;
- the spans calibrated on the fit run's clients instead (see `calibrated`): a per-step and a
  per-request term fitted on the fit run's live client figures (not its recording), for comparison;
- the evaluation run's own steps with its arrival stamps (the same plans as live,
  tests/record/test_twin_live.py), timed by their forwards and by their spans: what is left
  is time outside the worker's steps.

The last row sets the fit run's live figures against the evaluation run's: two live runs of traces of
one shape, the machine's own run-to-run spread. Each live run prints the load average before and
after it (the machine is shared).

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
from control_plane.record.entries import AddRequest, ApplyResult, Finished, Header  # noqa: E402
from control_plane.record.files import read_entries, read_header  # noqa: E402
from stepwise import costs, stamps, twin_recorded  # noqa: E402
from stepwise import simulate as sim  # noqa: E402
from stepwise.costs import ClientPath  # noqa: E402
from stepwise.up import stop_processes  # noqa: E402
from tests.processes import ready_file_sync  # noqa: E402

CLI = [sys.executable, "-m", "stepwise.cli"]
METRICS = (("ttft p50", "ttft_median_ms", "ttft_p50_s"), ("ttft p99", "ttft_p99_ms", "ttft_p99_s"))
METRICS += (("e2e p50", "e2e_latency_median_ms", "latency_p50_s"),)


def make_trace(
    path: Path,
    n: int,
    rate: float,
    prompt: tuple[int, int],
    output: tuple[int, int],
    seed: int,
    burst: int = 1,
) -> Path:
    """n requests, Poisson arrivals at `rate`/s in bursts of `burst` (a burst's requests arrive at
    once, bursts at rate/burst per second), prompt and output lengths uniform in the ranges; a
    quarter share a 64-token system prompt (so the prefix cache plays its part)."""
    rng = random.Random(seed)
    clock, lines = 0.0, []
    for i in range(n):
        line: dict[str, Any] = {"rid": f"s{seed}-{i}", "arrival": round(clock, 6)}
        line |= {"prompt_len": rng.randint(*prompt), "max_new_tokens": rng.randint(*output)}
        if i % 4 == 0:
            line |= {"prefix_group": "sys", "prefix_len": 64}
        lines.append(json.dumps(line))
        if (i + 1) % burst == 0:
            clock += rng.expovariate(rate / burst)
    path.write_text("\n".join(lines) + "\n")
    return path


def live_run(model: str, trace: Path, record: Path, work: Path) -> dict[str, Any]:
    """`stepwise up --model M --record DIR`, the trace sent by `stepwise bench`; bench's JSON report."""
    ready = work / f"ready-{record.name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWISE_")} | {"OMP_NUM_THREADS": "1"}
    up = [*CLI, "up", "--model", model, "--host", "127.0.0.1", "--port", "0", "--worker-port", "0"]
    up += ["--log-level", "warning", "--record", str(record), "--ready-file", str(ready)]
    print(f"live {record.name}: load average {_load()} before", flush=True)
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
        print(f"live {record.name}: load average {_load()} after", flush=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


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
    client: bool = False,
    jitter: bool = False,
) -> dict[str, Any]:
    """The trace simulated on `cost` (or these step seconds), with the cost file's client path if
    `client` and its residuals drawn per step if `jitter` (--cost-jitter); arriving by time, or at the
    steps `arrivals_of` stamped."""
    steps = costs.recorded_steps(cost) if seconds is None else None
    recorded = steps.seconds if steps is not None else seconds
    model = costs.parse_cost(cost) if recorded is None else sim.CostModel()
    path = costs.client_path(cost) if client else ClientPath()
    drawn = costs.residual_quantiles(cost) if jitter else ()
    # The steps `up`'s stop cut off (it is stopped as soon as the bench has its last finish).
    cut_off = steps.cut_off if steps is not None else frozenset()
    stamps = twin_recorded.read_worker(arrivals_of) if arrivals_of is not None else None
    if seconds is not None and stamps is not None:  # the spans of the recording that stamped them
        cut_off = stamps.cut_off
    setup = sim.SimSetup(
        header.scheduler,
        header.limits,
        model,
        recorded_seconds=recorded,
        client=path,
        jitter=drawn,
        recorded_cut_off=cut_off,
    )
    requests = [sim.to_request(e) for e in client_traces.load_trace(trace, header.limits.vocab_size)]
    if stamps is None:
        return sim.Simulation(setup, requests).run()
    return sim.Simulation(setup, requests, arrival_steps=stamps.arrivals, after_idle=stamps.after_idle).run()


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
    """The evaluation trace simulated on the span model `cost` calibrated on the fit run's live
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


def client_legs(work: Path, name: str) -> float:
    """The median over run `name`'s requests of the client's end to end less the control plane's
    (its recording's stamps: the call reaching the frontend to its finish being published): the
    client's way to the frontend and the last token's way back, which no recording holds."""
    received, published = {}, {}
    for entry in read_entries(work / f"rec-{name}"):
        if isinstance(entry, AddRequest) and entry.received_s > 0:
            received[entry.rid] = entry.received_s
        elif isinstance(entry, Finished) and entry.at_s > 0:
            published[entry.rid] = entry.at_s
    live = live_requests(work, name)
    legs = [
        live[rid][1] - (published[rid] - received[rid])
        for rid in live
        if rid in published and rid in received
    ]
    if not legs:
        raise SystemExit(f"{work / f'rec-{name}'}: not stamped (recorded before the stamps): record it again")
    return statistics.median(legs)


def shifted(summary: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The summary with every request's TTFT and end to end `seconds` longer."""
    return summary | {key: summary[key] + seconds for key in ("ttft_p50_s", "ttft_p99_s", "latency_p50_s")}


def recorded_spans(record: Path) -> dict[int, float]:
    """step id -> its span on the control plane's clock (stepwise/stamps.py), as --fit-interval
    times a stamped recording's steps; its forward where it has no span."""
    noted = stamps.Stamps()
    results = [e.result for e in noted.noting(read_entries(record)) if isinstance(e, ApplyResult)]
    if not noted.stamped:
        raise SystemExit(f"{record}: not stamped (recorded before the stamps): record it again")
    return {r.step_id: noted.spans.get(r.step_id, r.forward_s) for r in results}


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
    parser.add_argument(
        "--burst", type=int, default=1, help="requests arriving at once (bursts at rate/burst)"
    )
    parser.add_argument("--prompt-len", default="16,256")
    parser.add_argument("--output-len", default="8,64")
    parser.add_argument("--work", type=Path, default=None, help="keep traces and recordings here")
    parser.add_argument("--reuse", action="store_true", help="the live runs already in --work, not new ones")
    ns = parser.parse_args()
    prompt = tuple(map(int, ns.prompt_len.split(",")))
    output = tuple(map(int, ns.output_len.split(",")))
    work = ns.work or Path(tempfile.mkdtemp(prefix="twin-"))
    work.mkdir(parents=True, exist_ok=True)
    traces = {name: make_trace(work / f"{name}.jsonl", ns.requests, ns.rate, prompt, output, seed, ns.burst)  # type: ignore[arg-type]
              for name, seed in (("fit", 1), ("eval", 2))}  # fmt: skip
    live = {
        name: live_run(ns.model, trace, work / f"rec-{name}", work)
        if not (ns.reuse and (work / f"live-rec-{name}.json").exists())
        else json.loads((work / f"live-rec-{name}.json").read_text())["report"]
        for name, trace in traces.items()
    }
    header = read_header(work / "rec-eval")
    fitted = fit([work / "rec-fit"], work / "cost-fit.json")
    spans = fit([work / "rec-fit"], work / "cost-fit-span.json", "--fit-interval")
    legs = client_legs(work, "fit")
    twin = simulate(traces["eval"], header, str(spans), client=True)
    jittered = simulate(traces["eval"], header, str(spans), client=True, jitter=True)
    rows = {
        "forwards fitted on the other run": simulate(traces["eval"], header, str(fitted)),
        "spans fitted on the other run": simulate(traces["eval"], header, str(spans)),
        "spans and client path fitted on the other run's recording": twin,
        "the same, its residuals drawn per step (--cost-jitter)": jittered,
        "the same, plus the client's legs measured on the other run": shifted(jittered, legs),
        "spans fitted on the other run, calibrated on its clients": calibrated(work, traces, header, spans),
        "this run's own forwards, its arrival steps": simulate(
            traces["eval"], header, f"recorded:{work / 'rec-eval'}", work / "rec-eval"
        ),
        "this run's own spans, its arrival steps": simulate(
            traces["eval"], header, "", work / "rec-eval", recorded_spans(work / "rec-eval")
        ),
    }
    print(f"model {ns.model}, {ns.requests} requests at {ns.rate}/s in bursts of {ns.burst}, ", end="")
    print(f"prompts {ns.prompt_len}, ", end="")
    print(f"outputs {ns.output_len}; work in {work}")
    for name, report in live.items():
        keys = ("duration_s", "ttft_median_ms", "ttft_p99_ms", "e2e_latency_median_ms")
        print(f"live {name} run: {json.dumps({k: report[k] for k in keys})}")
    print(f"forwards fitted on the other run: {json.loads(fitted.read_text())['cost']}")
    fitted_spans = json.loads(spans.read_text())
    arrive, publish = fitted_spans["arrive_s"] * 1e3, fitted_spans["publish_s"] * 1e3
    print(
        f"spans fitted on the other run: {fitted_spans['cost']} (fitted to {fitted_spans['fitted_to']}); ",
        end="",
    )
    print(f"client path arrive {arrive:.3f} ms, publish {publish:.3f} ms; client's legs {legs * 1e3:.3f} ms")
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
