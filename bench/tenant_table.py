"""Tenants on one simulated worker or a fleet (not a test): `python bench/tenant_table.py [--trace
MOONCAKE] [--workers N]`.

Runs `stepwise simulate` in-process (the real scheduler, the sim worker, the simulated clock) and
prints the tables of docs/scheduler.md#tenant-figures; with `--workers N` the skew and slo tables
run on the fleet twin (`simulate --workers N`, stepwise/twin.py: N workers, each with the same
scheduler flags, behind the real router), the skew table's offered load N times the one worker's:

- **skew**: 8 tenants, four offering 4x the load of the other four, all backlogged: Jain's index of
  weighted service and throughput, FCFS against VTC;
- **isolation**: a well-behaved tenant alone, then beside a tenant that floods at 10x its rate: its
  p99 TTFT, FCFS against VTC;
- **shared prefixes**: 8 tenants over 200 prefix groups, lpm within the tenant: plain VTC against
  vtc-locality (bounds Q);
- **slo** (with `--trace`): the Mooncake conversation trace at 1.5x and 2x, tenants by the first hash
  id, objectives scaled to the cost model: attainment and goodput, FCFS without admission against
  SLO admission (fcfs and edf).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clients.traces import token_run  # noqa: E402
from control_plane.request import RequestParams  # noqa: E402
from protos.worker import SamplerParams  # noqa: E402
from stepwise import costs, traces, twin, twin_cli  # noqa: E402
from stepwise import simulate as sim  # noqa: E402

COST = "0.005,0.000025,0.00000002,0.0"
WORKER = ["--kv-tokens", "1048576", "--max-context", "131072", "--cost", COST]
VOCAB = 32000
# The SLO runs: a pool that holds the trace's working set, and prefill chunks mixed with the decodes
# (without it a 12k-token prompt's six prefill steps stall every running decode: TPOT 100 ms is lost).
SLO_WORKER = ["--kv-tokens", "8388608", "--max-context", "131072", "--cost", COST, "--enable-mixed-chunk"]


def _params(tenant: str, output: int, ttft_ms: float = 0.0, tpot_ms: float = 0.0) -> RequestParams:
    return RequestParams(
        max_new_tokens=output,
        sampler=SamplerParams(temperature=0.0),
        sim_output_len=sim.NEVER_EOS,
        tenant=tenant,
        ttft_slo_ms=ttft_ms,
        tpot_slo_ms=tpot_ms,
    )


def _request(rid: str, arrival: float, prompt: Sequence[int], params: RequestParams) -> sim.TraceRequest:
    return sim.TraceRequest(rid, arrival, tuple(prompt), params)


def open_loop(
    rates: dict[str, float], duration: float, prompt: int | tuple[int, int], output: int, seed: int
) -> list[sim.TraceRequest]:
    """Poisson arrivals per tenant (requests per second) for `duration` seconds, unique prompts
    (`prompt` tokens, or uniform in a (low, high) range), output lengths uniform in
    [output/8, 15·output/8] (mean `output`: slots free at staggered times)."""
    rng = random.Random(seed)
    low, high = prompt if isinstance(prompt, tuple) else (prompt, prompt)
    out: list[tuple[float, str, int, int]] = []
    for tenant, rate in sorted(rates.items()):
        t = rng.expovariate(rate)
        while t < duration:
            n = rng.randint(output // 8, 15 * output // 8)
            # A fixed prompt length draws nothing, so the tables' traces stay those of a fixed length.
            out.append((t, tenant, n, rng.randint(low, high) if high > low else low))
            t += rng.expovariate(rate)
    out.sort()
    return [
        _request(f"{tenant}/{i}", t, token_run(f"{tenant}/{i}", length, VOCAB), _params(tenant, n))
        for i, (t, tenant, n, length) in enumerate(out)
    ]


def grouped(
    tenants: int, groups: int, n: int, duration: float, prefix: int, own: int, output: int, seed: int
) -> list[sim.TraceRequest]:
    """n requests in `duration` s, each of a random prefix group (shared `prefix` tokens, then `own`
    of its own); the group's tenant sends it."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = duration * i / n
        # Each tenant has its own groups (its system prompts): group g belongs to tenant g % tenants.
        group = rng.randrange(groups)
        tenant = f"t{group % tenants}"
        ids = token_run(f"group/{group}", prefix, VOCAB) + token_run(f"r/{i}", own, VOCAB)
        out.append(_request(f"r{i}", t, ids, _params(tenant, output)))
    return out


def run(
    trace: list[sim.TraceRequest],
    flags: Sequence[str],
    worker: Sequence[str] = WORKER,
    fleet: Sequence[str] = (),
) -> tuple[dict[str, Any], float]:
    """One run; `fleet` (the fleet's flags, `--workers N` and the router's) runs it on the fleet twin,
    whose summary gains `tenant_workers` (each tenant's admitted requests by the worker that took them)
    and `moves` (migrations and hand-overs: requests that continued on another worker)."""
    ns = sim.build_parser().parse_args([*worker, *flags, *fleet])
    setup = sim.setup_from_args(ns)
    started = time.process_time()
    if fleet:
        fleet_twin = twin.Twin(twin_cli.setup_from_args(ns, setup, ()), trace)
        summary = fleet_twin.run()
        summary["tenant_workers"] = _tenant_workers(fleet_twin)
        summary["moves"] = sum(fleet_twin.migrations.values()) + fleet_twin.handed_over
        if "tenants" in summary:
            _end_to_end(fleet_twin, summary["tenants"])
        return summary, time.process_time() - started
    simulation = sim.Simulation(setup, trace)
    gaps = _watch_gaps(simulation.scheduler)
    summary = simulation.run()
    if gaps:
        summary["counter_gap_max"] = max(gaps)
    if "tenants" in summary:
        _end_to_end(simulation, summary["tenants"])
    return summary, time.process_time() - started


def _tenant_workers(fleet_twin: twin.Twin) -> dict[str, dict[str, int]]:
    """tenant -> worker -> requests of the tenant the worker took first (refused ones: none)."""
    assert fleet_twin.tenants is not None
    out: dict[str, dict[str, int]] = {}
    for rid, progress in fleet_twin.progress.items():
        if progress.workers:
            by_worker = out.setdefault(fleet_twin.tenants.requests[rid].tenant, {})
            by_worker[progress.workers[0]] = by_worker.get(progress.workers[0], 0) + 1
    return {t: dict(sorted(w.items(), key=lambda kv: int(kv[0]))) for t, w in sorted(out.items())}


def _end_to_end(simulation: Any, tenants: dict[str, dict[str, Any]]) -> None:
    """Each tenant's median time from arrival to its last token (`e2e_p50_s`): the isolation table
    shows what a short TTFT leaves of a request's wait."""
    spans: dict[str, list[float]] = {}
    for rid, progress in simulation.progress.items():
        if progress.finished is not None:
            tenant = simulation.tenants.requests[rid].tenant
            spans.setdefault(tenant, []).append(progress.finished - progress.arrival)
    for tenant, values in spans.items():
        if tenant in tenants:
            tenants[tenant]["e2e_p50_s"] = round(float(statistics.median(values)), 3)


def _watch_gaps(scheduler: Any) -> list[float]:
    """With fairness on: after each plan, the gap between the largest and the least counter among
    the backlogged tenants (the unfairness a locality bound allows), appended to the list returned."""
    counters = scheduler.fairness
    gaps: list[float] = []
    if counters is None:
        return gaps
    plan = scheduler.next_plan

    def watched(always: bool = False) -> Any:
        made = plan(always)
        backlogged = [counters.counter(t) for t, n in counters.waiting.items() if n > 0]
        if len(backlogged) > 1:
            gaps.append(max(backlogged) - min(backlogged))
        return made

    scheduler.next_plan = watched
    return gaps


def tok_s(summary: dict[str, Any]) -> float:
    return (summary["output_tokens"]) / summary["simulated_s"]


def row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def skew_table(
    rate: float,
    duration: float,
    preempt_bounds: Sequence[float] = (),
    fleet: Sequence[str] = (),
    prefix: int = 0,
    fairness: Sequence[str] = ("none", "vtc", "vtc-locality"),
) -> list[str]:
    """On a fleet (`fleet`: its flags, `--workers N` first) each tenant offers N times its rate, and
    a last column counts the heavy (t0-t3) and light (t4-t7) tenants' requests on each worker.
    `prefix`: each prompt's first tokens are its tenant's own system prompt of that many tokens."""
    rate *= int(fleet[1]) if fleet else 1
    rates = {f"t{i}": (4.0 if i < 4 else 1.0) * rate for i in range(8)}
    trace = open_loop(rates, duration, 512, 128, seed=1)
    if prefix:
        trace = [
            dataclasses.replace(
                r,
                input_ids=token_run(f"system/{r.params.tenant}", prefix, VOCAB) + tuple(r.input_ids[prefix:]),
            )
            for r in trace
        ]
    head = ["fairness", "jain index (backlogged)", "output tok/s", "x FCFS", "light tenants' TTFT p99 s"]
    head += ["cpu s", *(["heavy/light requests by worker"] if fleet else [])]
    lines = [
        f"8 tenants, t0-t3 at {4 * rate:g} req/s and t4-t7 at {rate:g} req/s for {duration:g} s "
        f"({len(trace)} requests, 512 prompt + 128 output tokens each"
        + (f", the first {prefix} the tenant's own" if prefix else "")
        + ")"
        + (f"; `{' '.join(fleet)}`" if fleet else ""),
        "",
        row(head),
        row(["---"] * len(head)),
    ]
    base = None
    runs: list[tuple[str, list[str]]] = [(name, ["--fairness", name]) for name in fairness]
    runs += [
        (f"vtc + preempt {b:g}", ["--fairness", "vtc", "--fairness-preempt-bound", f"{b:g}"])
        for b in preempt_bounds
    ]
    for name, flags in runs:
        summary, cpu = run(trace, flags, fleet=fleet)
        tput = tok_s(summary)
        base = base or tput
        tenants = summary["tenants"]
        light = max(tenants[f"t{i}"]["ttft_p99_s"] for i in range(4, 8))
        cells = [name, f"{summary['jain_index']:.4f}", f"{tput:,.1f}", f"{tput / base:.4f}", f"{light:.3f}"]
        cells.append(f"{cpu:.1f}")
        if fleet:
            cells.append(_heavy_light(summary["tenant_workers"]))
        lines.append(row(cells))
        print(lines[-1], file=sys.stderr, flush=True)  # a long run's rows as they come
        if fleet:  # which tenant ran where, and each tenant's service
            served = {t: v["served_tokens"] for t, v in tenants.items()}
            print(
                json.dumps({"tenant_workers": summary["tenant_workers"], "served": served}), file=sys.stderr
            )
    return lines


def _heavy_light(tenant_workers: dict[str, dict[str, int]]) -> str:
    """'w0 1200/310, w1 ...': each worker's requests of t0-t3 and of t4-t7."""
    counts: dict[str, list[int]] = {}
    for tenant, by_worker in tenant_workers.items():
        for worker, n in by_worker.items():
            counts.setdefault(worker, [0, 0])[0 if int(tenant[1:]) < 4 else 1] += n
    return ", ".join(
        f"w{w} {h}/{light}" for w, (h, light) in sorted(counts.items(), key=lambda kv: int(kv[0]))
    )


def isolation_table(
    rate: float,
    duration: float,
    caps: Sequence[int],
    preempt_bounds: Sequence[float] = (),
    flags_all: Sequence[str] = (),
    isolations: Sequence[tuple[int, int, float, bool]] = (),
) -> list[str]:
    good = open_loop({"good": rate}, duration, 512, 128, seed=2)
    both = sorted(good + open_loop({"flood": 10 * rate}, duration, 512, 128, seed=3), key=lambda r: r.arrival)
    lines = [
        f"tenant `good` at {rate:g} req/s, `flood` at {10 * rate:g} req/s, {duration:g} s, 512 prompt "
        "tokens, 16-240 output tokens",
        "",
        row(
            [
                "--max-running-requests",
                "run",
                "fairness",
                "good TTFT p50 s",
                "good TTFT p99 s",
                "p99 x alone",
                "good end-to-end p50 s",
                "flood TTFT p99 s",
                "output tok/s",
                "x FCFS",
            ]
        ),
        row(["---"] * 10),
    ]
    for cap in caps:
        extra = [*(["--max-running-requests", str(cap)] if cap else []), *flags_all]
        alone, _ = run(good, ["--fairness", "none", *extra])
        g = alone["tenants"]["good"]
        p99 = g["ttft_p99_s"]
        label = str(cap) if cap else "(KV-bound)"
        lines.append(
            row(
                [
                    label,
                    "good alone",
                    "none",
                    g["ttft_p50_s"],
                    p99,
                    "1.00",
                    g["e2e_p50_s"],
                    "-",
                    f"{tok_s(alone):,.1f}",
                    "-",
                ]
            )
        )
        runs: list[tuple[str, list[str]]] = [("none", ["--fairness", "none"]), ("vtc", ["--fairness", "vtc"])]
        runs += [
            (f"vtc + preempt {b:g}", ["--fairness", "vtc", "--fairness-preempt-bound", f"{b:g}"])
            for b in preempt_bounds
        ]
        for tokens, running, grace, turn in isolations:
            name = f"vtc + isolation {tokens}" + (f", running {running}" if running else "")
            name += (f", grace {grace:g}" if grace else "") + (", decode turn" if turn else "")
            runs.append((name, ["--fairness", "vtc", *_isolation_flags(tokens, running, grace, turn)]))
        fcfs = 0.0
        for name, flags in runs:
            summary, _ = run(both, [*flags, *extra])
            g, f = summary["tenants"]["good"], summary["tenants"]["flood"]
            tput = tok_s(summary)
            fcfs = fcfs or tput
            lines.append(
                row(
                    [
                        label,
                        "beside flood",
                        name,
                        g["ttft_p50_s"],
                        g["ttft_p99_s"],
                        f"{g['ttft_p99_s'] / p99:.2f}",
                        g["e2e_p50_s"],
                        f["ttft_p99_s"],
                        f"{tput:,.1f}",
                        f"{tput / fcfs:.3f}",
                    ]
                )
            )
    return lines


# The grid's length mixes: (prompt tokens or a uniform range, mean output tokens) for good, then flood.
MIXES: dict[str, tuple[tuple[int | tuple[int, int], int], tuple[int | tuple[int, int], int]]] = {
    "512/128": ((512, 128), (512, 128)),
    "varied": (((128, 2048), 128), ((128, 2048), 128)),
    "long-flood": ((512, 128), ((2048, 8192), 128)),
    "long-output": ((256, 512), (256, 512)),
}


def grid_rows(
    rates: Sequence[float],
    durations: Sequence[float],
    mixes: Sequence[str],
    seeds: Sequence[int],
    overlaps: Sequence[bool],
    caps: Sequence[int],
    isolations: Sequence[tuple[int, int, float, bool]],
    flags_all: Sequence[str] = (),
) -> None:
    """The isolation goal over a grid (printed row by row): for each good rate, trace length, length
    mix, overlap, cap and seed, good's TTFT p99 beside a flood at 10x its rate over its alone-run's,
    FCFS, VTC and VTC with each step isolation `T[:R]` (with its output tok/s over FCFS's)."""
    names = ["fcfs", "vtc", *(f"iso {t}:{r}:{g:g}" + (":turn" if d else "") for t, r, g, d in isolations)]
    head = ["good req/s", "s", "mix", "overlap", "cap", "seed", "good reqs", "alone p99 s"]
    head += [f"{n} p99 x" for n in names] + [f"{n} x FCFS tok/s" for n in names[2:]]
    print(row(head))
    print(row(["---"] * len(head)), flush=True)
    for rate in rates:
        for duration in durations:
            for mix in mixes:
                (gp, go), (fp, fo) = MIXES[mix]
                for seed in seeds:
                    good = open_loop({"good": rate}, duration, gp, go, seed=2 * seed)
                    flood = open_loop({"flood": 10 * rate}, duration, fp, fo, seed=2 * seed + 1)
                    both = sorted(good + flood, key=lambda r: r.arrival)
                    for overlap in overlaps:
                        for cap in caps:
                            extra = [*(["--max-running-requests", str(cap)] if cap else []), *flags_all]
                            if not overlap:
                                extra.append("--disable-overlap-schedule")
                            alone = run(good, ["--fairness", "none", *extra])[0]["tenants"]["good"]
                            p99s, tputs = [], []
                            runs = [["--fairness", "none"], ["--fairness", "vtc"]]
                            runs += [["--fairness", "vtc", *_isolation_flags(*spec)] for spec in isolations]
                            for flags in runs:
                                summary, _ = run(both, [*flags, *extra])
                                p99s.append(summary["tenants"]["good"]["ttft_p99_s"] / alone["ttft_p99_s"])
                                tputs.append(tok_s(summary))
                            cells: list[object] = [
                                f"{rate:g}",
                                f"{duration:g}",
                                mix,
                                "on" if overlap else "off",
                            ]
                            cells += [cap or "KV", seed, alone["requests"], alone["ttft_p99_s"]]
                            cells += [f"{x:.2f}" for x in p99s] + [f"{x / tputs[0]:.3f}" for x in tputs[2:]]
                            print(row(cells), flush=True)


def locality_table(n: int, duration: float, bounds: Sequence[float], kv_tokens: int = 1048576) -> list[str]:
    trace = grouped(8, 200, n, duration, prefix=1024, own=256, output=32, seed=4)
    worker = [*WORKER]
    worker[worker.index("--kv-tokens") + 1] = str(kv_tokens)
    lines = [
        f"8 tenants with 25 prefix groups each (1,024 shared + 256 own tokens, 32 output), {n} requests in "
        f"{duration:g} s; `--schedule-policy lpm --cache-aware-queue-limit 0` within each tenant; "
        f"`--kv-tokens {kv_tokens}` (the 200 prefixes: 204,800 tokens)",
        "",
        row(
            [
                "fairness",
                "Q",
                "hit rate",
                "output tok/s",
                "x vtc",
                "jain index (backlogged)",
                "largest counter gap",
                "TTFT p99 s",
                "cpu s",
            ]
        ),
        row(["---"] * 9),
    ]
    lpm = ["--schedule-policy", "lpm", "--cache-aware-queue-limit", "0"]
    base = None
    runs = [("none", 0.0), ("vtc", 0.0), *(("vtc-locality", q) for q in bounds)]
    for name, q in runs:
        summary, cpu = run(trace, [*lpm, "--fairness", name, "--fairness-locality-bound", str(q)], worker)
        tput = tok_s(summary)
        if name == "vtc":
            base = tput
        ratio = f"{tput / base:.3f}" if base else "-"
        lines.append(
            row(
                [
                    name,
                    f"{q:g}" if name == "vtc-locality" else "-",
                    summary["hit_rate"],
                    f"{tput:,.1f}",
                    ratio,
                    summary["jain_index"],
                    f"{summary['counter_gap_max']:,.0f}" if "counter_gap_max" in summary else "-",
                    summary["ttft_p99_s"],
                    f"{cpu:.1f}",
                ]
            )
        )
    return lines


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tables", nargs="*", default=["skew", "isolation", "locality", "slo"])
    parser.add_argument("--trace", type=Path, help="the Mooncake conversation trace (the slo table)")
    parser.add_argument("--limit", type=int, default=1500)
    parser.add_argument(
        "--locality-kv-tokens", type=int, nargs="*", default=[1048576], help="locality: pools"
    )
    parser.add_argument("--locality-bounds", type=float, nargs="*", default=[4096.0, 65536.0])
    parser.add_argument("--isolation-flags", default="", help="isolation: more simulate flags, every run")
    parser.add_argument("--isolation-seconds", type=float, default=30.0, help="isolation: the trace's length")
    parser.add_argument(
        "--preempt-bounds",
        type=float,
        nargs="*",
        default=[256.0, 4096.0],
        help="skew and isolation: VTC rows with --fairness-preempt-bound B, for each B",
    )
    parser.add_argument("--grid-rates", type=float, nargs="*", default=[2.0, 4.0, 8.0, 16.0])
    parser.add_argument("--grid-seconds", type=float, nargs="*", default=[30.0])
    parser.add_argument("--grid-mixes", nargs="*", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--grid-seeds", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--grid-overlap", nargs="*", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--grid-caps", type=int, nargs="*", default=[0, 256], help="grid: 0 is KV-bound")
    parser.add_argument(
        "--isolation-tokens",
        nargs="*",
        default=[],
        metavar="T[:R[:G[:turn]]]",
        help="isolation and grid: VTC rows with --fairness-isolation-tokens T (and "
        "--fairness-isolation-running R, --fairness-isolation-grace G, --fairness-isolation-decode-turn)",
    )
    parser.add_argument(
        "--workers", type=int, help="skew and slo: on the fleet twin of N workers (default: one worker)"
    )
    parser.add_argument(
        "--routing-policy", choices=["cache-aware", "least-loaded"], help="with --workers: the router's"
    )
    parser.add_argument(
        "--skew-prefix", type=int, default=0, help="skew: each tenant's prompts share their first N tokens"
    )
    parser.add_argument(
        "--skew-fairness",
        nargs="*",
        default=["none", "vtc", "vtc-locality"],
        choices=["none", "vtc", "vtc-locality"],
        help="skew: the --fairness rows (the first is the x FCFS base)",
    )
    parser.add_argument("--skew-rate", type=float, default=10.0, help="skew: the light tenants' req/s")
    parser.add_argument("--skew-seconds", type=float, default=30.0, help="skew: the trace's length")
    parser.add_argument("--loads", type=float, nargs="*", default=[1.5, 2.0], help="slo: the load scales")
    parser.add_argument(
        "--slo-rows",
        nargs="*",
        default=["none", "fcfs", "edf"],
        choices=["none", "fcfs", "edf"],
        help="slo: FCFS without admission, SLO admission with fcfs, with edf",
    )
    parser.add_argument("--slo-model", default=COST, help="slo: the worker's --cost (and --slo-cost)")
    parser.add_argument("--slo-kv-tokens", type=int, default=8388608, help="slo: the worker's pool")
    ns = parser.parse_args(argv)
    fleet: list[str] = []
    if ns.workers is not None:
        fleet = ["--workers", str(ns.workers)]
        fleet += ["--routing-policy", ns.routing_policy] if ns.routing_policy else []
    out: list[str] = []
    if "skew" in ns.tables:
        out += [
            "### skew",
            "",
            *skew_table(
                ns.skew_rate, ns.skew_seconds, ns.preempt_bounds, fleet, ns.skew_prefix, ns.skew_fairness
            ),
            "",
        ]
    if "isolation" in ns.tables:
        out += [
            "### isolation",
            "",
            *isolation_table(
                8.0,
                ns.isolation_seconds,
                [0, 256],
                ns.preempt_bounds,
                ns.isolation_flags.split(),
                [_isolation_spec(spec) for spec in ns.isolation_tokens],
            ),
            "",
        ]
    if "grid" in ns.tables:
        grid_rows(
            ns.grid_rates,
            ns.grid_seconds,
            ns.grid_mixes,
            ns.grid_seeds,
            [o == "on" for o in ns.grid_overlap],
            ns.grid_caps,
            [_isolation_spec(spec) for spec in ns.isolation_tokens],
            ns.isolation_flags.split(),
        )
    if "locality" in ns.tables:
        for kv in ns.locality_kv_tokens:
            out += ["### shared prefixes", "", *locality_table(4000, 20.0, ns.locality_bounds, kv), ""]
    if "slo" in ns.tables and ns.trace is not None:
        worker = slo_worker(ns.slo_model, ns.slo_kv_tokens)
        out += [
            "### slo",
            "",
            *slo_table(ns.trace, ns.limit, loads=ns.loads, fleet=fleet, worker=worker, rows=ns.slo_rows),
            "",
        ]
    print("\n".join(out))
    return 0


def _isolation_spec(spec: str) -> tuple[int, int, float, bool]:
    """'T', 'T:R', 'T:R:G' or 'T:R:G:turn' -> (T, R, G, the decode turn)."""
    tokens, running, grace, turn = [*spec.split(":"), "", "", ""][:4]
    return int(tokens), int(running or 0), float(grace or 0), turn == "turn"


def _isolation_flags(tokens: int, running: int, grace: float, turn: bool = False) -> list[str]:
    flags = ["--fairness-isolation-tokens", str(tokens), "--fairness-isolation-running", str(running)]
    flags += ["--fairness-isolation-grace", f"{grace:g}"] if grace else []
    return flags + (["--fairness-isolation-decode-turn"] if turn else [])


def mooncake_tenants(
    path: Path, limit: int, load: float, ttft_ms: float, tpot_ms: float
) -> list[sim.TraceRequest]:
    """The Mooncake trace's first `limit` requests at `load` times its rate, each of tenant
    t{crc32(first hash id) % 8} (a conversation keeps its tenant), with both objectives."""
    ns = sim.build_parser().parse_args(
        [str(path), "--trace-format", "mooncake", "--limit", str(limit), "--load-scale", str(load)]
    )
    out = []
    for r in traces.read_trace(ns, VOCAB):
        first = r.input_ids.hashes[0] if r.input_ids.hashes else 0  # type: ignore[attr-defined]
        tenant = f"t{zlib.crc32(str(first).encode()) % 8}"
        params = dataclasses.replace(r.params, tenant=tenant, ttft_slo_ms=ttft_ms, tpot_slo_ms=tpot_ms)
        out.append(dataclasses.replace(r, params=params))
    return out


def slo_worker(cost: str, kv_tokens: int) -> list[str]:
    """The slo table's worker flags: SLO_WORKER with another cost model (what --cost takes) or pool."""
    return ["--kv-tokens", str(kv_tokens), "--max-context", "131072", "--cost", cost, "--enable-mixed-chunk"]


def slo_table(
    path: Path,
    limit: int,
    ttft_ms: float = 2000.0,
    tpot_ms: float = 100.0,
    loads: Sequence[float] = (1.5, 2.0),
    fleet: Sequence[str] = (),
    worker: Sequence[str] = SLO_WORKER,
    rows: Sequence[str] = ("none", "fcfs", "edf"),
) -> list[str]:
    """`rows`: FCFS without admission ("none"), SLO admission with fcfs and with edf; x FCFS needs
    "none". `--slo-cost` is the worker's own `--cost` model."""
    model = costs.parse_cost(worker[worker.index("--cost") + 1])
    slo_cost = ",".join(repr(x) for x in (model.a, model.b, model.c, model.d))
    first = f"first {limit}" if limit else "all"
    lines = [
        f"the Mooncake conversation trace, {first} requests, 8 tenants by first hash id, every request "
        f"with ttft_slo_ms {ttft_ms:g} and tpot_slo_ms {tpot_ms:g}; worker `{' '.join(worker)}`"
        + (f"; `{' '.join(fleet)}`" if fleet else ""),
        "",
        row(
            [
                "load",
                "admission",
                "policy",
                "refused",
                "attainment (admitted)",
                "goodput req/s",
                "x FCFS",
                "TTFT p99 s",
                "cpu s",
            ]
        ),
        row(["---"] * 9),
    ]
    runs = [
        (a, p)
        for a, p in (("none", "fcfs"), ("slo", "fcfs"), ("slo", "edf"))
        if (p if a == "slo" else a) in rows
    ]
    for load in loads:
        trace = mooncake_tenants(path, limit, load, ttft_ms, tpot_ms)
        base = 0.0
        for admission, policy in runs:
            flags = ["--schedule-policy", policy]
            if admission == "slo":
                flags += ["--slo-cost", slo_cost]
            summary, cpu = run(trace, flags, worker, fleet)
            goodput = summary["goodput_rps"]
            if admission == "none":
                base = goodput
            ratio = (
                "-"
                if admission == "none" or "none" not in rows
                else (f"{goodput / base:.2f}" if base else "inf")
            )
            lines.append(
                row(
                    [
                        f"{load:g}x",
                        admission,
                        policy,
                        summary["slo_rejected"],
                        summary["slo_attainment"],
                        goodput,
                        ratio,
                        summary["ttft_p99_s"],
                        f"{cpu:.1f}",
                    ]
                ),
            )
            print(lines[-1], file=sys.stderr, flush=True)  # a long run's rows as they come
            if fleet:  # requests that continued on another worker (a move, a hand-over)
                print(json.dumps({"moves": summary["moves"]}), file=sys.stderr, flush=True)
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
