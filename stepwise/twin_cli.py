"""`stepwise simulate`'s fleet flags (--workers, --roles, --worker-cost, --event, the link, SLOs,
--per-request, --plot) and what the fleet's run prints (docs/debugging.md#a-fleet-of-sim-workers)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np

from control_plane import config as control_config
from control_plane.core.fleet import Rules
from flagtypes import Float, Int
from flagtypes.table import Flag, Flags
from stepwise import costs, twin
from stepwise.simulate import SimSetup, _round

TWIN_FLAGS = Flags(
    None,
    (
        Flag(
            "--workers",
            Int(1, 4096),
            help="simulate a fleet of N sim workers behind the real router and placement (default: one "
            "worker, as without this flag; --workers 1 prints the same bytes)",
        ),
        Flag(
            "--roles",
            default="",
            help="each worker's role: 'prefill,decode,decode' or counts 'p:1,d:2' (prefill, decode, mixed; "
            "default: all mixed)",
        ),
        Flag(
            "--worker-cost",
            default="",
            help="step cost per worker or per role: 'WHO=COST;WHO=COST', WHO a worker index or a role, COST "
            "what --cost takes (the others get --cost)",
        ),
        Flag(
            "--event",
            action="append",
            default=[],
            help="a fleet event on the simulated clock, repeatable: 'kill:W@SECONDS', 'drain:W@SECONDS', "
            "'add@SECONDS' or 'add:ROLE@SECONDS' (trace lines {'event': ..., 'worker': W, 'at': SECONDS} "
            "too)",
        ),
        Flag(
            "--link-gbps",
            Float(1e-6, 1e6, unit="GB/s"),
            default=twin.DEFAULT_LINK_GBPS,
            help="the KV link's bandwidth between workers in GB/s: a move's copy takes its bytes over it",
        ),
        Flag(
            "--kv-bytes-per-token",
            Int(1, 1 << 30),
            default=twin.DEFAULT_KV_BYTES_PER_TOKEN,
            help="bytes of KV per token a move copies (default: Llama-3-8B's, 128 KiB)",
        ),
        Flag("--slo-ttft", Float(0, 1e9, unit="seconds"), help="TTFT objective (seconds)"),
        Flag("--slo-tpot", Float(0, 1e9, unit="seconds"), help="TPOT objective (seconds)"),
        Flag(
            "--per-request",
            Path,
            help="write one JSON line per request (TTFT, TPOT, end to end, queue, cache hits, workers) there",
        ),
        Flag(
            "--plot",
            Path,
            help="draw latency CDFs and load over time into this PNG (needs the 'plot' extra: matplotlib)",
        ),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    TWIN_FLAGS.add_to(parser)


def wanted(ns: argparse.Namespace, events: Sequence[twin.FleetEvent]) -> bool:
    """The fleet runs when any of its flags is given, or the trace has fleet events."""
    return bool(
        ns.workers is not None
        or ns.roles
        or ns.worker_cost
        or ns.event
        or events
        or ns.slo_ttft is not None
        or ns.slo_tpot is not None
        or ns.per_request is not None
        or ns.plot is not None
    )


def trace_events(ns: argparse.Namespace) -> list[twin.FleetEvent]:
    if ns.trace_format != "stepwise" or ns.trace is None:
        return []
    return twin.read_events(ns.trace)


def setup_from_args(
    ns: argparse.Namespace, base: SimSetup, trace_events: Sequence[twin.FleetEvent]
) -> twin.TwinSetup:
    """ValueError (exit 2) naming the flag for a bad one."""
    roles = twin.parse_roles(ns.roles, ns.workers)
    if base.recorded_seconds is not None:
        # The fleet's clocks are its cost models'; a live fleet's recording is replayed by
        # stepwise/twin_recorded.py (docs/debugging.md#twin).
        raise ValueError("--cost recorded:DIR times one worker's steps: not with the fleet's flags")
    if len(roles) > 1 and ns.record is not None:
        raise ValueError("--record records one worker's scheduler: not with more than one worker")
    each, by_role = twin.parse_worker_costs(ns.worker_cost, roles, base.cost, costs.parse_cost)
    jitters: tuple[tuple[float, ...], ...] = ()
    role_jitters: dict[str, tuple[float, ...]] = {}
    if base.jitter:  # each worker draws from its own cost file's residuals
        residuals = partial(costs.residual_quantiles, flag="--worker-cost")
        jitters, role_jitters = twin.parse_worker_costs(ns.worker_cost, roles, base.jitter, residuals)
    events = sorted([twin.parse_event(text) for text in ns.event] + list(trace_events), key=lambda e: e.at)
    known = len(roles)
    for event in events:
        if event.kind == "add":
            known += 1
        elif event.worker >= known:
            raise ValueError(
                f"event {event.kind}:{event.worker}@{event.at:g}: there is no worker {event.worker}"
            )
    return twin.TwinSetup(
        base,
        roles,
        each,
        routing=control_config.routing_from_args(ns),
        rules=Rules(
            ns.kv_balance_steps,
            ns.kv_balance_threshold,
            not ns.disable_kv_balance,
            control_config.test_migrate_interval({}),
        ),
        drain_migration=not ns.disable_drain_migration,
        drain_timeout_s=ns.drain_timeout,
        events=tuple(events),
        kv_bytes_per_token=ns.kv_bytes_per_token,
        link_gbps=ns.link_gbps,
        role_costs=by_role,
        jitters=jitters,
        role_jitters=role_jitters,
        slo_ttft_s=ns.slo_ttft,
        slo_tpot_s=ns.slo_tpot,
    )


# --- the report --------------------------------------------------------------------------------------


def request_rows(sim: twin.Twin) -> list[dict[str, object]]:
    """Per request: its latencies (seconds, None where it never got there), hits and workers."""
    rows = []
    for p in sim.progress.values():
        ttft = None if p.first_token is None else p.first_token - p.arrival
        e2e = None if p.finished is None else p.finished - p.arrival
        tpot = None
        if p.first_token is not None and p.finished is not None and p.output_tokens > 1:
            tpot = (p.finished - p.first_token) / (p.output_tokens - 1)
        queue = None if p.admitted is None else p.admitted - p.arrival
        rows.append(
            {
                "rid": p.rid,
                "arrival_s": _round(p.arrival),
                "ttft_s": _maybe(ttft),
                "tpot_s": _maybe(tpot),
                "e2e_s": _maybe(e2e),
                "queue_s": _maybe(queue),
                "prompt_tokens": p.prompt_tokens,
                "output_tokens": p.output_tokens,
                "cached_tokens": p.cached_tokens,
                "workers": p.workers,
                "finish": p.reason,
            }
        )
    return rows


def fleet_summary(sim: twin.Twin, rows: list[dict[str, object]]) -> dict[str, object]:
    setup = sim.setup
    span = sim.end or 1.0
    ok = [r for r in rows if r["finish"] in ("stop", "length")]
    meets_ttft = [setup.slo_ttft_s is None or _le(r["ttft_s"], setup.slo_ttft_s) for r in ok]
    meets_tpot = [
        setup.slo_tpot_s is None or r["tpot_s"] is None or _le(r["tpot_s"], setup.slo_tpot_s) for r in ok
    ]
    both = sum(a and b for a, b in zip(meets_ttft, meets_tpot, strict=True))
    out: dict[str, object] = {"workers": len(sim.workers)}
    for name in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        values = [r[name] for r in ok if r[name] is not None]
        out[name] = _percentiles(values)  # type: ignore[arg-type]
    n = len(ok) or 1
    out["slo"] = {
        "ttft_s": setup.slo_ttft_s,
        "tpot_s": setup.slo_tpot_s,
        "ttft_attained": _round(sum(meets_ttft) / n),
        "tpot_attained": _round(sum(meets_tpot) / n),
        "both_attained": _round(both / n),
        "goodput_rps": _round(both / span),
    }
    out["completed_rps"] = _round(len(ok) / span)
    out["per_worker"] = [
        {
            "worker": w.worker,
            "role": w.limits.role,
            "steps": w.steps,
            "prefill_tokens": w.prefill_tokens,
            "utilisation": _round(w.busy_s / span),
            "served": sum(w.worker in r["workers"] for r in rows),  # type: ignore[operator,misc]
            "state": "up" if w.alive else ("drained" if w.drain_deadline is not None else "killed"),
        }
        for w in sim.workers
    ]
    out["routing"] = dict(sorted(sim.router.decisions.items()))
    out["migrations"] = dict(sorted(sim.migrations.items()))
    out["migrated_bytes"] = sim.migrated_bytes
    out["migration_fallbacks"] = sim.migration_fallbacks
    out["handed_over"] = sim.handed_over
    out["recomputed_tokens"] = sim.recomputed_tokens
    return out


def _le(value: object, bound: float) -> bool:
    return value is not None and float(value) <= bound  # type: ignore[arg-type]


def _maybe(x: float | None) -> float | None:
    return None if x is None else _round(x)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.asarray(values)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99]).tolist()
    return {"p50": _round(p50), "p90": _round(p90), "p99": _round(p99), "mean": _round(arr.mean())}


def shows_fleet(ns: argparse.Namespace, setup: twin.TwinSetup) -> bool:
    """A fleet of one with no fleet flag but --workers 1 prints what the single worker prints."""
    return len(setup.roles) > 1 or bool(setup.events) or twin_flags(ns)


def twin_flags(ns: argparse.Namespace) -> bool:
    return bool(
        ns.roles
        or ns.worker_cost
        or ns.slo_ttft is not None
        or ns.slo_tpot is not None
        or ns.per_request is not None
        or ns.plot is not None
    )


def write_rows(path: Path, rows: list[dict[str, object]]) -> None:
    with path.open("w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")


def plot(path: Path, sim: twin.Twin, rows: list[dict[str, object]]) -> None:
    """Latency CDFs and the fleet's queue and running requests over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'stepwise[plot]'") from None
    fig, (cdf, load) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        values = np.sort([float(r[name]) for r in rows if r[name] is not None])  # type: ignore[arg-type]
        if len(values):
            cdf.plot(values, np.arange(1, len(values) + 1) / len(values), label=name.removesuffix("_s"))
    cdf.set_xscale("symlog", linthresh=0.01)
    cdf.set_xlabel("seconds")
    cdf.set_ylabel("fraction of requests")
    cdf.legend()
    cdf.set_title("latency CDFs")
    if sim.load_samples:
        t, queued, running = zip(*sim.load_samples, strict=True)
        load.plot(t, queued, label="queued")
        load.plot(t, running, label="running")
    load.set_xlabel("simulated seconds")
    load.set_ylabel("requests (whole fleet)")
    load.legend()
    load.set_title(f"load over time, {len(sim.workers)} workers")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(ns: argparse.Namespace, sim: twin.Twin) -> None:
    """Print the fleet's line (after the summary), and write --per-request and --plot."""
    rows = request_rows(sim)
    if ns.per_request is not None:
        write_rows(ns.per_request, rows)
    if ns.plot is not None:
        plot(ns.plot, sim, rows)
    print(json.dumps({"fleet": fleet_summary(sim, rows)}))
