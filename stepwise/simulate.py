"""`stepwise simulate TRACE.jsonl`: the real scheduler driving the sim backend, in one process.

No network and no wall clock: the clock advances by the cost model's time for each step, and
requests arrive when the clock passes their `arrival`. Plans and results cross the worker link's codec
(stepwise/wire.py), so the wire format is exercised. By default two plans are in flight (SGLang's
overlap scheduling: the next plan is made while the worker runs the current one, so it is made on
the clock of the previous step's end); `--disable-overlap-schedule` applies each result first.
Output: the timeline (one line per step, the same as `stepwise replay show`), then a summary. Two
runs on the same input print the same bytes.

Trace lines are JSON objects: `rid`, `arrival` (seconds, lines sorted by it), a prompt as
`prompt_ids` or `prompt_len` (+ `prefix_group`, `prefix_len`: a group's requests share their first
prefix_len tokens), `max_new_tokens`, and optionally `output_len` (tokens before EOS; default:
never EOS), `priority`, `routing_key`, `ignore_eos`, `abort_at` (seconds, at or after `arrival`: the
request is aborted at the first turn whose clock has reached it, after that turn's arrivals, where the
engine applies an abort from its inbox), `tenant`, `ttft_slo_ms`, `tpot_slo_ms`
(docs/scheduler.md#simulating-tenants: `--tenants FILE` gives their weights, objectives and quotas).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from clients import traces as client_traces
from clients.traces import NEVER_EOS as NEVER_EOS
from clients.traces import TraceEntry
from clients.traces import TraceError as TraceError
from control_plane import config as control_config
from control_plane.config import SchedulerConfig
from control_plane.record.recorder import (
    RecordingScheduler,
    Sink,
    Tee,
    open_file_sink,
    recording_header,
)
from control_plane.record.timeline import StepLine, TimelineSink
from control_plane.request import AbortCode, FinishReason, RequestParams
from control_plane.scheduler.scheduler import QueueFull, RequestRejected, Scheduler
from control_plane.tenants import table as tenant_table
from control_plane.tenants.book import TenantBook
from control_plane.tenants.table import TenantTable
from data_plane.sim import CostModel, SimExecutor
from flagtypes import INT32_MAX, SEED, Int
from flagtypes.table import SWITCH, Flag, Flags
from protos.worker import SamplerParams, StepResult, WorkerLimits
from stepwise import cost_fit, costs, flags
from stepwise.costs import ClientPath
from stepwise.jitter import Jitter
from stepwise.tenant_summary import TenantLedger
from stepwise.wire import step_through_wire

DEFAULT_KV_TOKENS = 1 << 18
DEFAULT_COST = "0.005,0.00005,0.0000005"
# Plans in flight with overlap scheduling (SGLang's: the one running and the one being planned).
OVERLAP_DEPTH = 2
# Why a trace line's `abort_at` ended its request (a client's cancel).
TRACE_ABORT = FinishReason.abort("aborted by the trace (abort_at)", AbortCode.CANCELLED)


class SimulationStuck(RuntimeError):
    """Requests remain but the scheduler plans nothing and no arrival is pending."""


class RecordingTooShort(RuntimeError):
    """`--cost recorded:DIR`: the simulation ran a step the recording did not measure."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    rid: str
    arrival: float
    input_ids: Sequence[int]
    params: RequestParams
    # When the client cancels it, on the simulated clock (None: never).
    abort_at: float | None = None


@dataclass(frozen=True, slots=True)
class SimSetup:
    config: SchedulerConfig
    limits: WorkerLimits
    cost: CostModel
    seed: int = 0
    overlap: bool = True
    # `--cost recorded:DIR`: each step's seconds as a live run measured them (step id -> forward_s),
    # the clock's instead of the cost model's.
    recorded_seconds: Mapping[int, float] | None = None
    # `--tenants FILE`: its quotas are checked at each arrival as a live control plane's core checks
    # them (its weights and objectives are in `config`).
    tenants: TenantTable | None = None
    # A fitted model's client path (arrivals by time only): each request reaches the scheduler
    # `arrive_s` after its arrival, and each token and finish is published `publish_s` after its step.
    client: ClientPath = dataclasses.field(default_factory=ClientPath)
    # `--cost-jitter`: quantiles (evenly spaced levels 0..1) of a fit's residuals; each step adds
    # one draw (seeded by `seed`: stepwise/jitter.py), its seconds kept >= 0.
    jitter: tuple[float, ...] = ()
    # `--cost recorded:DIR`: the recording's planned steps after its last measured one (a stop cut
    # them off: stepwise.costs.RecordedSteps); each takes 0 s once every request has finished.
    recorded_cut_off: frozenset[int] = frozenset()


# --- the trace ------------------------------------------------------------------------------------


def to_request(entry: TraceEntry) -> TraceRequest:
    """A trace line (clients/traces.py reads both formats) as the scheduler takes it."""
    params = RequestParams(
        max_new_tokens=entry.max_new_tokens,
        ignore_eos=entry.ignore_eos,
        sampler=SamplerParams(temperature=0.0),
        priority=entry.priority,
        routing_key=entry.routing_key,
        sim_output_len=entry.output_len,
        tenant=entry.tenant,
        ttft_slo_ms=entry.ttft_slo_ms,
        tpot_slo_ms=entry.tpot_slo_ms,
    )
    return TraceRequest(entry.rid, entry.arrival, entry.input_ids, params, entry.abort_at)


def load_trace(path: Path, vocab_size: int) -> list[TraceRequest]:
    return [to_request(entry) for entry in client_traces.load_trace(path, vocab_size)]


def about_tenants(setup: SimSetup, trace: Sequence[TraceRequest]) -> bool:
    """Whether the summary carries the tenant figures: anything in the run is about tenants or
    objectives (the single-worker and fleet simulators alike)."""
    config = setup.config
    return bool(
        setup.tenants is not None
        or config.fairness != "none"
        or config.tenant_weights
        or config.tenant_slos
        or any(r.params.tenant or r.params.ttft_slo_ms or r.params.tpot_slo_ms for r in trace)
    )


# --- the loop -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Progress:
    arrival: float
    prompt_tokens: int
    first_token: float | None = None
    finished: float | None = None
    reason: str = ""
    output_tokens: int = 0
    cached_tokens: int = 0


class Simulation:
    """The scheduler and a SimExecutor on a simulated clock.

    `arrival_steps` (rid -> step), when given, makes each request arrive when the scheduler has made
    that many plans instead of when the clock reaches its arrival: a live recording's stamps, so that a
    simulation of a live run sees each arrival between the same two plans (docs/debugging.md#twin).
    The requests in `after_idle` arrived live after the scheduler went idle at their step (an OnIdle
    of that step came first): they wait for the simulation's scheduler to go idle there too."""

    def __init__(
        self,
        setup: SimSetup,
        trace: Sequence[TraceRequest],
        sink: Sink | None = None,
        arrival_steps: Mapping[str, int] | None = None,
        after_idle: Collection[str] = (),
    ) -> None:
        self.setup = setup
        self.arrival_steps = arrival_steps
        self.after_idle = after_idle
        # The step at which the scheduler last went idle.
        self.idled_at = -1
        if sink is None:
            self.scheduler = Scheduler(setup.config, setup.limits)
        else:
            self.scheduler = RecordingScheduler(setup.config, setup.limits, sink)
        limits = setup.limits
        eos = min(limits.eos_token_ids)
        self.executor = SimExecutor(limits.kv_capacity_tokens, limits.vocab_size, eos, setup.cost, setup.seed)
        self.pending = deque(trace)
        # (abort_at, line order, rid), soonest first.
        self.aborts = deque(
            sorted((r.abort_at, i, r.rid) for i, r in enumerate(trace) if r.abort_at is not None)
        )
        self.progress: dict[str, _Progress] = {}
        # uid -> progress (the uid is the arrival's index + 1).
        self.by_uid: dict[int, _Progress] = {}
        self.in_flight: deque[StepResult] = deque()
        self.depth = OVERLAP_DEPTH if setup.overlap else 1
        self.clock = 0.0
        self.steps = 0
        self.jittered = Jitter(setup.jitter, setup.seed)
        self.tenants = TenantLedger(setup.config, {r.params.tenant for r in trace})
        # The tenant file's quotas, the core's book over them (control_plane/tenants/book.py).
        self.quotas = TenantBook.of(setup.tenants) if setup.tenants is not None else None
        self.by_tenant = about_tenants(setup, trace)
        self.rid_of_uid: dict[int, str] = {}
        self.uid_of_rid: dict[str, int] = {}
        # The steps of `recorded_cut_off` that came, each taking 0 s.
        self.unmeasured: list[int] = []

    def run(self) -> dict[str, object]:
        while self._step():
            pass
        return self.summary()

    def _step(self) -> bool:
        """Plan, let the worker run it, and apply the oldest result once `depth` plans are in flight
        (or nothing new was planned). The worker never waits: the clock is the sum of step times."""
        self._arrive()
        self._abort_due()
        plan = self.scheduler.next_plan()
        self._collect()
        if plan is not None:
            result = step_through_wire(self.executor, plan)
            if result.error:
                raise RuntimeError(f"sim worker failed step {plan.step_id}: {result.error}")
            self.in_flight.append(result)
            self.tenants.planned(plan, self.clock)
            if self.quotas is not None:
                for seq in plan.new_seqs:  # a sample's first prefill: no longer queued
                    self.quotas.admitted(self.uid_of_rid[seq.request_id])
        elif not self.in_flight:
            return self._wait()
        if len(self.in_flight) >= self.depth or plan is None:
            self._apply(self.in_flight.popleft())
        return True

    def _apply(self, result: StepResult) -> None:
        self.clock += self.jittered(self._seconds(result))
        self.scheduler.apply_result(result)
        self.steps += 1
        self._collect()

    def _seconds(self, result: StepResult) -> float:
        recorded = self.setup.recorded_seconds
        if recorded is None:
            return result.forward_s
        if result.step_id in recorded:
            return recorded[result.step_id]
        if result.step_id in self.setup.recorded_cut_off and self._all_finished():
            # A step a stop cut off (overlap planned it before the last finish was published): live
            # never measured it either, and no token or finish of it reaches a client.
            self.unmeasured.append(result.step_id)
            return 0.0
        raise RecordingTooShort(f"step {result.step_id} was not measured in the recording")

    def _all_finished(self) -> bool:
        """Every request of the trace has arrived and finished (or been refused)."""
        return not self.pending and all(p.finished is not None for p in self.progress.values())

    def _due(self, request: TraceRequest) -> bool:
        if self.arrival_steps is None:
            return self.setup.client.reaches(request.arrival) <= self.clock
        step, now = self.arrival_steps[request.rid], self.scheduler.step_id
        return step < now or (step == now and (request.rid not in self.after_idle or self.idled_at == now))

    def _wait(self) -> bool:
        """Nothing to plan: go idle, then jump the clock to the next arrival (False when done)."""
        if self.scheduler.is_idle:
            self.scheduler.on_idle()
            self.idled_at = self.scheduler.step_id
        if self.pending:
            if self.arrival_steps is None:
                self.clock = max(self.clock, self.setup.client.reaches(self.pending[0].arrival))
            elif not self._due(self.pending[0]):  # by step, the next arrival must be due now
                rid, step = self.pending[0].rid, self.scheduler.step_id
                raise SimulationStuck(
                    f"{rid} arrives at step {self.arrival_steps[rid]}; nothing planned at {step}"
                )
            return True
        if not self.scheduler.is_idle:
            raise SimulationStuck(f"{len(self.scheduler.requests)} requests left, nothing planned")
        return False

    def _arrive(self) -> None:
        while self.pending and self._due(self.pending[0]):
            req = self.pending.popleft()
            # Arriving by step, a request's latencies count from when it arrived on this clock.
            arrival = req.arrival if self.arrival_steps is None else self.clock
            progress = _Progress(arrival, len(req.input_ids))
            self.progress[req.rid] = progress
            uid = len(self.progress)
            self.by_uid[uid] = progress
            self.rid_of_uid[uid] = req.rid
            self.uid_of_rid[req.rid] = uid
            p = req.params
            self.tenants.arrived(req.rid, p.tenant, p.ttft_slo_ms, p.tpot_slo_ms)
            refused = self._over_quota(req, uid)
            if refused is None:
                try:
                    self.scheduler.add_request(req.rid, req.input_ids, req.params, uid)
                except (QueueFull, RequestRejected, ValueError) as exc:
                    refused = type(exc).__name__
                    if self.quotas is not None:
                        self.quotas.refused(uid, refused)
                else:
                    if self.quotas is not None:
                        self.quotas.accepted(uid)
            if refused is not None:
                progress.finished, progress.reason = self.clock, f"refused: {refused}"
                self.tenants.answered(req.rid)

    def _over_quota(self, req: TraceRequest, uid: int) -> str | None:
        """The quota the request is over (the tenant file's, checked when it reaches the core)."""
        if self.quotas is None:
            return None
        refusal = self.quotas.arrive(req.params.tenant, (uid,), len(req.input_ids), self.clock)
        return None if refusal is None else refusal.field

    def _abort_due(self) -> None:
        """The aborts whose time the clock has reached, after this turn's arrivals (so each finds its
        request arrived): as the engine applies the aborts in its inbox before it plans. One whose request
        has ended, or was refused at arrival, finds nothing."""
        while self.aborts and self.aborts[0][0] <= self.clock:
            _, _, rid = self.aborts.popleft()
            self.scheduler.abort(rid, TRACE_ABORT)

    def _collect(self) -> None:
        updates = self.scheduler.take_updates()
        uids, counts = np.unique(updates.tokens.uids, return_counts=True)
        published = self.setup.client.published(self.clock)
        for uid, count in zip(uids.tolist(), counts.tolist(), strict=True):
            progress = self.by_uid[uid]
            if progress.first_token is None:
                progress.first_token = published
                self.tenants.answered(self.rid_of_uid[uid])
            progress.output_tokens += count
            self.tenants.output(self.rid_of_uid[uid], count, self.clock)
        if self.quotas is not None:
            self.quotas.tokens(updates.tokens.uids.tolist(), self.clock)
        for finished in updates.finished:
            progress = self.progress[finished.rid]
            if progress.first_token is None:
                self.tenants.answered(finished.rid)
            progress.finished, progress.reason = published, finished.reason.kind.value
            progress.cached_tokens = finished.cached_tokens
            if self.quotas is not None:
                self.quotas.ended(self.uid_of_rid[finished.rid])

    def summary(self) -> dict[str, object]:
        retractions = self.scheduler.num_retracted_total
        tenants = self.tenants.summary(self.progress, self.clock) if self.by_tenant else {}
        return {**summarize(self.progress.values(), self.steps, self.clock, retractions), **tenants}


class RequestProgress(Protocol):
    """What the summary reads of each request's progress (the single-worker and fleet simulators')."""

    @property
    def arrival(self) -> float: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def first_token(self) -> float | None: ...
    @property
    def finished(self) -> float | None: ...
    @property
    def reason(self) -> str: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...


def summarize(
    progress: Iterable[RequestProgress], steps: int, end_s: float, retractions: int
) -> dict[str, object]:
    """The summary line: counts, the prefix-cache hit rate and TTFT/latency over every request."""
    done = list(progress)
    prompt = sum(p.prompt_tokens for p in done)
    cached = sum(p.cached_tokens for p in done)
    ttft = [p.first_token - p.arrival for p in done if p.first_token is not None]
    latency = [p.finished - p.arrival for p in done if p.finished is not None]
    return {
        "requests": len(done),
        "finish_reasons": dict(sorted(Counter(p.reason for p in done).items())),
        "steps": steps,
        "simulated_s": _round(end_s),
        "output_tokens": sum(p.output_tokens for p in done),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": _round(cached / prompt if prompt else 0.0),
        "retractions": retractions,
        **_distribution("ttft", ttft),
        **_distribution("latency", latency),
    }


def _round(x: float) -> float:
    return round(float(x), 6)


def _distribution(name: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"{name}_mean_s": None, f"{name}_p50_s": None, f"{name}_p99_s": None}
    arr = np.asarray(values)
    return {
        f"{name}_mean_s": _round(arr.mean()),
        f"{name}_p50_s": _round(np.percentile(arr, 50)),
        f"{name}_p99_s": _round(np.percentile(arr, 99)),
    }


# --- command line ---------------------------------------------------------------------------------


_TRACE = Flags(
    None, (Flag("trace", Path, nargs="?", help="JSON lines, one request each, sorted by arrival"),)
)
# The simulated worker and its model.
_SIM_FLAGS = Flags(
    None,
    (
        # The simulated pool is allocated in this process: its cap keeps that to a few GiB at most.
        Flag(
            "--kv-tokens",
            Int(1, 1 << 27),
            default=DEFAULT_KV_TOKENS,
            help="the simulated worker's KV capacity",
        ),
        Flag("--max-context", Int(2, 1 << 24), default=32768, help="the simulated model's context in tokens"),
        Flag("--vocab-size", Int(4, INT32_MAX), default=32000, help="the simulated model's vocabulary size"),
        Flag(
            "--eos-token-id", Int(0, INT32_MAX), default=2, help="the token id the simulated model ends with"
        ),
        Flag(
            "--cost",
            default=DEFAULT_COST,
            help="step time: 'a,b,c[,d]' (a + b·new tokens + c·context + d·decode rows, in seconds), a named "
            f"model ({costs.describe_named()}: docs/performance.md#step-cost-models), a JSON file with a, b, "
            "c, d, or recorded:DIR (each step's seconds as the recording in DIR measured them)",
        ),
    ),
)
_OUTPUT_FLAGS = Flags(
    None,
    (
        Flag(
            "--sim-seed", SEED, default=0, help="seed of the simulated tokens (and of --cost-jitter's draws)"
        ),
        Flag(
            "--cost-jitter",
            SWITCH,
            help="with --cost FILE from --fit-cost --json: add to each step a draw from the fit's residuals "
            "(measured less modelled seconds), so the simulated tail carries the recorded run's stalls; on a "
            "fleet each worker draws its own, from its --worker-cost FILE's residuals where it has one",
        ),
        Flag("--json", SWITCH, help="one JSON object per step, then {'summary': ...}"),
        Flag("--summary-only", SWITCH, help="print the summary only (no timeline)"),
    ),
)


def build_parser() -> argparse.ArgumentParser:
    from stepwise import traces, twin_cli  # they read this module's trace types

    parser = flags.ArgumentParser(
        prog="stepwise simulate", description="the real scheduler on a request trace with a sim worker"
    )
    _TRACE.add_to(parser)
    control_config.add_arguments(parser)
    _SIM_FLAGS.add_to(parser)
    cost_fit.add_arguments(parser)
    # --tenants is the control plane's flag (control_config.add_arguments): the same file.
    _OUTPUT_FLAGS.add_to(parser)
    traces.add_arguments(parser)
    twin_cli.add_arguments(parser)
    flags.apply_env_defaults(parser)
    return parser


def setup_from_args(ns: argparse.Namespace) -> SimSetup:
    config = control_config.scheduler_config_from_args(ns)
    table = None
    if ns.tenants is not None:
        table = tenant_table.load(ns.tenants)
        tenant_table.check_objectives(table, config.slo_cost)
        config = dataclasses.replace(config, tenant_weights=table.weights(), tenant_slos=table.slo_defaults())
        control_config.validate_scheduler_config(config)
    page = config.page_size or 1
    steps = costs.recorded_steps(ns.cost)
    recorded = None if steps is None else steps.seconds
    cost = costs.parse_cost(ns.cost) if recorded is None else CostModel()
    limits = WorkerLimits(
        worker_id="sim",
        kv_capacity_tokens=ns.kv_tokens // page * page,
        page_size=page,
        max_context=ns.max_context,
        vocab_size=ns.vocab_size,
        eos_token_ids=frozenset({ns.eos_token_id}),
        model_fingerprint="sim",
        dtype="sim",
        device="sim",
    )
    client = costs.client_path(ns.cost) if recorded is None else ClientPath()
    jitter = costs.residual_quantiles(ns.cost) if ns.cost_jitter else ()
    overlap = not ns.disable_overlap_schedule
    cut_off = frozenset() if steps is None else steps.cut_off
    return SimSetup(config, limits, cost, ns.sim_seed, overlap, recorded, table, client, jitter, cut_off)


def _sink(ns: argparse.Namespace, setup: SimSetup, emit: Callable[[StepLine], None]) -> Sink | None:
    sinks: list[Sink] = []
    # The recording first: a closed stdout (the timeline's) must not keep it from being closed.
    if ns.record is not None:
        header = recording_header(setup.config, setup.limits, "stepwise simulate", **{"sim.seed": setup.seed})
        sinks.append(open_file_sink(ns.record, header, ns.record_max_bytes))
    if not ns.summary_only:
        sinks.append(TimelineSink(emit))
    return Tee(sinks) if sinks else None


def _unmeasured_note(steps: Sequence[int]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]} was not measured (the recording stopped while it ran): it took 0 s"
    listed = ", ".join(map(str, steps))
    return f"steps {listed} were not measured (the recording stopped while they ran): they took 0 s"


def main(argv: Sequence[str]) -> int:
    from stepwise import traces, twin_cli
    from stepwise.replay import print_table  # rich is loaded only for the table

    parser = build_parser()
    ns = parser.parse_args(argv)
    if (fitted := cost_fit.run_from_args(parser, ns)) is not None:
        return fitted
    try:
        setup = setup_from_args(ns)
        trace = traces.read_trace(ns, setup.limits.vocab_size)
        events = twin_cli.trace_events(ns)
        fleet = twin_cli.setup_from_args(ns, setup, events) if twin_cli.wanted(ns, events) else None
    except (OSError, ValueError) as exc:
        print(f"stepwise simulate: {exc}", file=sys.stderr)
        return 2
    lines: list[StepLine] = []
    emit = (lambda line: print(json.dumps(line.to_json()))) if ns.json else lines.append
    try:
        sink = _sink(ns, setup, emit)
    except OSError as exc:
        print(f"stepwise simulate: --record {ns.record}: cannot write there: {exc}", file=sys.stderr)
        return 2
    twin = simulation = None
    try:
        if fleet is None:
            simulation = Simulation(setup, trace, sink)
            summary = simulation.run()
        else:
            twin = twin_cli.twin.Twin(fleet, trace, sink if len(fleet.roles) == 1 else None)
            summary = twin.run()
    except SimulationStuck as exc:
        print(f"stepwise simulate: stuck: {exc}", file=sys.stderr)
        return 1
    except RecordingTooShort as exc:
        print(f"stepwise simulate: --cost {ns.cost}: {exc}", file=sys.stderr)
        return 1
    finally:
        if sink is not None:
            with contextlib.suppress(BrokenPipeError):
                sink.close()
    if not ns.json and lines:
        print_table(lines)
    print(json.dumps({"summary": summary}))
    if simulation is not None and simulation.unmeasured:
        print(
            f"stepwise simulate: --cost {ns.cost}: {_unmeasured_note(simulation.unmeasured)}", file=sys.stderr
        )
    if twin is not None and fleet is not None and twin_cli.shows_fleet(ns, fleet):
        try:
            twin_cli.report(ns, twin)
        except (OSError, ValueError) as exc:
            print(f"stepwise simulate: {exc}", file=sys.stderr)
            return 2
    return 0
