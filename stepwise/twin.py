"""`stepwise simulate --workers N`: one control plane's fleet of sim workers on one simulated clock.

The decisions are the live core's own objects: a real Scheduler per worker, the fleet's Router
(where a new request runs, who inherits a lost worker's requests), Fleet.place / Fleet.drain
(PD hand-off, KV balance and spill, drain moves: placement.py) and handover.continuation (how a
request continues elsewhere). What the live engine does with asyncio and gRPC is re-created here
around them, at its minimum: each worker's loop is the single-worker simulator's turn (arrivals,
aborts, plan, apply the oldest result of `depth` in flight) run as an event at the worker's clock;
a move finishes its call at the source (Scheduler.export) and lands after the copy's time on the
link (bytes / --link-gbps) as a KV import plus the continuation (Scheduler.import_kv, add_request).
Deterministic: events at one instant run in a fixed order (fleet events, arrivals, aborts,
landings, worker turns), then in the order they were made. As in the single-worker simulator, a
fitted cost's client path delays each arrival (`arrive_s`) and each publication (`publish_s`),
`--cost-jitter` adds a draw to each step (stepwise/jitter.py: each worker its own generator), and a
tenant file's quotas are the core's book (control_plane/tenants/book.py), one over the fleet,
checked at each arrival before the router picks a worker.

Events (`--event KIND:WORKER@SECONDS`, or trace lines `{"event": KIND, "worker": W, "at": T}`):
`kill` (the worker is lost at its first step boundary at or after T: plans in flight are lost, its
live requests continue on the router's heir by recompute), `drain` (it takes no new requests, hands
its queued ones to the heir, migrates the running ones, and leaves once empty or past
--drain-timeout, after which the rest recompute on the heir) and `add` (`add@T` or `add:ROLE@T`: a
new worker, numbered next, attaches at T).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import re
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np

from control_plane.config import RoutingConfig
from control_plane.core.drain import HANDED_OVER
from control_plane.core.fleet import BALANCE_REASONS, Fleet, Move, Room, Router, Rules, Spill
from control_plane.core.fleet.placement import Call
from control_plane.core.handover import continuation
from control_plane.core.migration import MIGRATED
from control_plane.record.recorder import RecordingScheduler, Sink
from control_plane.request import Request, RequestParams
from control_plane.scheduler.scheduler import QueueFull, RequestRejected, Scheduler
from control_plane.tenants.book import TenantBook
from data_plane.sim import CostModel, SimExecutor
from protos.worker import StepPlan, StepResult, WorkerLimits
from stepwise.jitter import Jitter
from stepwise.simulate import (
    OVERLAP_DEPTH,
    TRACE_ABORT,
    SimSetup,
    SimulationStuck,
    TraceError,
    TraceRequest,
    about_tenants,
    summarize,
)
from stepwise.tenant_summary import TenantLedger
from stepwise.wire import step_through_wire

T = TypeVar("T")
ROLES = ("prefill", "decode", "mixed")
ROLE_ALIASES = {"p": "prefill", "d": "decode", "m": "mixed", **{r: r for r in ROLES}}
EVENT_KINDS = ("kill", "drain", "add")
# Llama-3-8B's KV per token: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes.
DEFAULT_KV_BYTES_PER_TOKEN = 131072
DEFAULT_LINK_GBPS = 25.0
_EVENT = re.compile(r"^(kill|drain|add)(?::([A-Za-z0-9]+))?@([0-9.eE+-]+)$")
# Order of events at one instant.
_FLEET, _ARRIVAL, _ABORT, _LAND, _TURN = range(5)


@dataclass(frozen=True, slots=True)
class FleetEvent:
    kind: str
    at: float
    # The worker's index (kill, drain); for add, -1.
    worker: int = -1
    role: str = "mixed"


@dataclass(frozen=True, slots=True)
class TwinSetup:
    base: SimSetup
    # One entry per initial worker.
    roles: tuple[str, ...]
    costs: tuple[CostModel, ...]
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    rules: Rules = field(default_factory=Rules)
    drain_migration: bool = True
    drain_timeout_s: float = 30.0
    events: tuple[FleetEvent, ...] = ()
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    link_gbps: float = DEFAULT_LINK_GBPS
    # The cost of a worker an `add` event attaches, by role (default: the base cost).
    role_costs: dict[str, CostModel] = field(default_factory=dict)
    # `--cost-jitter`: each initial worker's residual quantiles (its cost file's; empty: none), and
    # an added worker's by role (default: the base's). Each worker draws with its own generator.
    jitters: tuple[tuple[float, ...], ...] = ()
    role_jitters: dict[str, tuple[float, ...]] = field(default_factory=dict)
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # Plans and results through the worker codec (encoded, serialised, parsed, decoded) as between
    # processes; False hands them to the in-process executor as they are (a third of a step's CPU),
    # which tests/record/test_twin.py proves prints the same bytes.
    wire: bool = False


# --- parsing the fleet's flags ----------------------------------------------------------------------


def parse_event(text: str) -> FleetEvent:
    """`kill:1@30`, `drain:0@12.5`, `add@60` or `add:decode@60`."""
    m = _EVENT.match(text.strip())
    if m is None:
        raise ValueError(f"--event {text!r}: want KIND:WORKER@SECONDS (kill, drain) or add[:ROLE]@SECONDS")
    kind, who, at_text = m.groups()
    try:
        at = float(at_text)
    except ValueError:
        raise ValueError(f"--event {text!r}: {at_text!r} is not a number of seconds") from None
    if not math.isfinite(at) or at < 0:
        raise ValueError(f"--event {text!r}: the time must be finite and not negative")
    return _event(kind, who, at, f"--event {text!r}")


def _event(kind: str, who: str | None, at: float, where: str) -> FleetEvent:
    if kind == "add":
        role = ROLE_ALIASES.get(who or "mixed")
        if role is None:
            raise ValueError(f"{where}: role {who!r} is not one of {', '.join(ROLES)}")
        return FleetEvent(kind, at, -1, role)
    if who is None or not who.isdigit():
        raise ValueError(f"{where}: {kind} needs a worker index (e.g. {kind}:1@{at:g})")
    return FleetEvent(kind, at, int(who))


def event_from_line(obj: dict[str, object], where: str) -> FleetEvent:
    """A trace line `{"event": "kill", "worker": 1, "at": 30}` (add: `"role"` instead of worker)."""
    kind = obj.get("event")
    if kind not in EVENT_KINDS:
        raise TraceError(f"{where}: event: want one of {', '.join(EVENT_KINDS)}, got {kind!r}")
    at = obj.get("at")
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at) or at < 0:
        raise TraceError(f"{where}: at: want seconds on the simulated clock (a number >= 0), got {at!r}")
    if kind == "add":
        who = obj.get("role", "mixed")
    else:
        worker = obj.get("worker")
        if isinstance(worker, bool) or not isinstance(worker, int) or worker < 0:
            raise TraceError(f"{where}: worker: want a worker index (an integer >= 0), got {worker!r}")
        who = str(worker)
    try:
        return _event(str(kind), str(who), float(at), where)
    except ValueError as exc:
        raise TraceError(str(exc)) from None


def read_events(path: Path) -> list[FleetEvent]:
    """The fleet events among a trace's lines (the lines with an `event` key)."""
    events = []
    with path.open() as lines:
        for lineno, text in enumerate(lines, start=1):
            if '"event"' not in text:
                continue
            try:
                obj = json.loads(text)
            except ValueError:
                continue  # the trace reader reports it
            if isinstance(obj, dict) and "event" in obj:
                events.append(event_from_line(obj, f"{path}:{lineno}"))
    return events


def parse_roles(text: str, workers: int | None) -> tuple[str, ...]:
    """`prefill,decode,decode` or `p:1,d:2` (counts); empty: every worker mixed. `workers` None:
    as many as the roles name (one without roles)."""
    if not text:
        return ("mixed",) * (workers or 1)
    roles: list[str] = []
    for part in text.split(","):
        name, _, count = part.strip().partition(":")
        role = ROLE_ALIASES.get(name)
        if role is None:
            raise ValueError(f"--roles: {name!r} is not one of {', '.join(ROLES)} (or p, d, m)")
        if count and not count.isdigit():
            raise ValueError(f"--roles: {part!r}: the count must be a whole number")
        roles.extend([role] * (int(count) if count else 1))
    if workers is not None and len(roles) != workers:
        raise ValueError(f"--roles: names {len(roles)} workers, --workers is {workers}")
    if not roles:
        raise ValueError("--roles: names no worker")
    return tuple(roles)


def parse_worker_costs(
    text: str, roles: Sequence[str], default: T, parse: Callable[[str], T]
) -> tuple[tuple[T, ...], dict[str, T]]:
    """`WHO=COST;WHO=COST`, WHO a worker index or a role, COST what --cost takes, read by `parse`
    (the step model, or a fitted file's residuals). An index wins over a role; the rest get
    `default` (--cost's). Returns each worker's and the ones by role."""
    by_index: dict[int, T] = {}
    by_role: dict[str, T] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        who, eq, spec = part.partition("=")
        if not eq or not spec:
            raise ValueError(f"--worker-cost: {part!r}: want WHO=COST (WHO: a worker index or a role)")
        cost = parse(spec)
        if who.isdigit():
            if int(who) >= len(roles):
                raise ValueError(f"--worker-cost: worker {who} is not one of the {len(roles)} workers")
            by_index[int(who)] = cost
        elif who in ROLE_ALIASES:
            by_role[ROLE_ALIASES[who]] = cost
        else:
            raise ValueError(f"--worker-cost: {who!r} is neither a worker index nor a role")
    each = tuple(by_index.get(i, by_role.get(role, default)) for i, role in enumerate(roles))
    return each, by_role


# --- one worker --------------------------------------------------------------------------------------


class _Received:
    """The destination's store of copies that landed (the twin times the copy; the sim checks sizes)."""

    def __init__(self) -> None:
        self.copies: dict[str, _Copy] = {}

    def take(self, transfer_id: str) -> _Copy:
        return self.copies.pop(transfer_id)

    def discard(self, transfer_id: str) -> None:
        self.copies.pop(transfer_id, None)


@dataclass(frozen=True, slots=True)
class _Copy:
    k: np.ndarray


class _Link:
    """A sim worker's transfer link inside one process: sends are timed by the twin, not carried."""

    def __init__(self) -> None:
        self.received = _Received()

    def send(self, address: str, transfer_id: str, copy: object) -> None:
        pass

    def take_outcomes(self) -> tuple[()]:
        return ()

    def landed(self, transfer_id: str, positions: int) -> None:
        self.received.copies[transfer_id] = _Copy(np.empty((1, positions), dtype=np.int8))


@dataclass(slots=True)
class _Orphan:
    rid: str
    input_ids: Sequence[int]
    params: RequestParams
    # A migration's copy: its transfer id and the tokens whose KV it holds ("": recompute).
    transfer_id: str = ""
    tokens: Sequence[int] = ()


@dataclass(slots=True)
class _Transit:
    source: str
    to: str
    reason: str


class SimWorker:
    """One worker as the fleet sees it (control_plane/core/fleet/member.py's Member)."""

    def __init__(
        self, index: int, limits: WorkerLimits, scheduler: Scheduler, executor: SimExecutor, jitter: Jitter
    ) -> None:
        self.index = index
        self.jitter = jitter
        self._limits = limits
        self._scheduler = scheduler
        self.executor = executor
        self.link = _Link()
        executor.transfers = self.link  # type: ignore[assignment]
        self.clock = 0.0
        self.busy_s = 0.0
        # Prompt (and recomputed) tokens its plans extended.
        self.prefill_tokens = 0
        self._steps = 0
        self.in_flight: deque[StepResult] = deque()
        self.arrivals: list[TraceRequest] = []
        self.orphans: list[_Orphan] = []
        self.aborts: list[str] = []
        # A turn is on the event queue (False: asleep until something comes).
        self.scheduled = False
        self.alive = True
        self.drain_deadline: float | None = None
        self.drain_begun = False
        self.due: list[FleetEvent] = []
        # Calls moving from here, by rid (for the fleet's heading and balancing).
        self.transits: dict[str, _Transit] = {}
        # Requests admitted (queue time) and those still queued here: rid -> arrival clock.
        self.queued: dict[str, float] = {}
        self.spill_to: str | None = None
        self.attached = 0.0

    # Member
    @property
    def worker(self) -> str:
        return self._limits.worker_id

    @property
    def limits(self) -> WorkerLimits:
        return self._limits

    @property
    def serving(self) -> bool:
        return self.alive and self.drain_deadline is None

    @property
    def leaving(self) -> object | None:
        return None if self.drain_deadline is None else "drain"

    @property
    def attached_at(self) -> float:
        return self.attached

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    def load(self) -> tuple[int, int]:
        sched = self._scheduler
        return len(sched.waiting) + len(self.arrivals) + len(self.orphans), len(sched.running)

    def room(self, steps: int) -> Room:
        sched = self._scheduler
        return Room(sched.decode_headroom(steps), sched.capacity, len(sched.waiting))

    def calls(self, steps: int, by_retraction: bool) -> list[Call]:
        """As the engine's `calls`: every trace request is a call of one sample."""
        sched = self._scheduler
        if by_retraction:
            rids = [rid for rid in sched.retraction_order()]
        else:
            rids = [req.rid for req in sched.live_requests()]
        out = []
        for rid in rids:
            req = sched.running_request(rid)
            out.append(
                Call(
                    (rid,),
                    tokens=req.kv_allocated_len if req is not None else 0,
                    movable=req is not None and rid not in self.transits,
                    started=req is None or req.num_outputs > 0,
                    ends_soon=req is not None and req.max_new_tokens - req.num_outputs <= steps,
                )
            )
        return out

    def balancing(self) -> bool:
        return any(t.reason in BALANCE_REASONS for t in self.transits.values())

    def heading(self) -> Counter[str]:
        return Counter(t.to for t in self.transits.values())

    def knows(self, rid: str) -> bool:
        return rid in self._scheduler.requests

    def stop(self) -> None:
        self.alive = False

    def destination_gone(self, worker: str, why: str) -> None:
        """Copies to `worker` fail when they land (the twin checks the destination then)."""


# --- the fleet -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Progress:
    rid: str
    arrival: float
    prompt_tokens: int
    uid: int
    owner: SimWorker | None = None
    workers: list[str] = field(default_factory=list)
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    reason: str = ""
    output_tokens: int = 0
    cached_tokens: int = 0
    moved: bool = False
    aborted: bool = False


class Twin:
    """N sim workers, each with a real Scheduler, behind the fleet's Router and placement."""

    def __init__(self, setup: TwinSetup, trace: Sequence[TraceRequest], sink: Sink | None = None) -> None:
        self.setup = setup
        self.sink = sink
        self.depth = OVERLAP_DEPTH if setup.base.overlap else 1
        self.now = 0.0
        self.router: Router[SimWorker] = Router("sim", routing=setup.routing)
        self.fleet: Fleet[SimWorker] = Fleet(self.router, clock=lambda: self.now)
        self.workers: list[SimWorker] = []
        self.progress: dict[str, _Progress] = {}
        self.by_uid: dict[int, _Progress] = {}
        self._queue: list[tuple[float, int, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._transfers = itertools.count(1)
        self.migrations: Counter[str] = Counter()
        self.migrated_bytes = 0
        self.migration_fallbacks = 0
        self.handed_over = 0
        self.recomputed_tokens = 0
        self.steps = 0
        self.end = 0.0
        # (time, queued, running) samples for --plot, one per step of any worker at most every 1 s.
        self.load_samples: list[tuple[float, int, int]] = []
        base = setup.base
        # The tenants' service (when the run is about tenants), and the tenant file's quotas: the
        # control plane's book, one over the whole fleet as a live control plane has.
        ledger = TenantLedger(base.config, {r.params.tenant for r in trace})
        self.tenants = ledger if about_tenants(base, trace) else None
        self.quotas = TenantBook.of(base.tenants) if base.tenants is not None else None
        jitters = setup.jitters or (base.jitter,) * len(setup.roles)
        for role, cost, quantiles in zip(setup.roles, setup.costs, jitters, strict=True):
            self._attach(role, cost, quantiles)
        for req in trace:
            self._at(base.client.reaches(req.arrival), _ARRIVAL, partial(self._arrive, req))
            if req.abort_at is not None:
                self._at(req.abort_at, _ABORT, partial(self._abort, req.rid))
        for event in setup.events:
            self._at(event.at, _FLEET, partial(self._fleet_event, event))

    # --- the event queue

    def _at(self, when: float, kind: int, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (when, kind, next(self._order), action))

    def run(self) -> dict[str, object]:
        queue = self._queue
        while queue:
            when, _, _, action = heapq.heappop(queue)
            self.now = when
            action()
        stuck = [w for w in self.workers if w.alive and w.scheduler.requests]
        if stuck:
            left = sum(len(w.scheduler.requests) for w in stuck)
            raise SimulationStuck(f"{left} requests left, nothing planned")
        return self.summary()

    # --- workers joining and leaving

    def _attach(self, role: str, cost: CostModel, quantiles: Sequence[float]) -> SimWorker:
        base = self.setup.base
        index = len(self.workers)
        limits = base.limits
        limits = WorkerLimits(
            worker_id=str(index),
            kv_capacity_tokens=limits.kv_capacity_tokens,
            page_size=limits.page_size,
            max_context=limits.max_context,
            vocab_size=limits.vocab_size,
            eos_token_ids=limits.eos_token_ids,
            model_fingerprint=limits.model_fingerprint,
            dtype=limits.dtype,
            device=limits.device,
            role=role,
            transfer_address=f"sim:{index}",
        )
        scheduler = self._new_scheduler(index, limits)
        eos = min(limits.eos_token_ids)
        executor = SimExecutor(limits.kv_capacity_tokens, limits.vocab_size, eos, cost, base.seed)
        worker = SimWorker(index, limits, scheduler, executor, Jitter(quantiles, base.seed, index))
        worker.clock = worker.attached = self.now
        self.workers.append(worker)
        self.router.attach(worker)
        return worker

    def _new_scheduler(self, index: int, limits: WorkerLimits) -> Scheduler:
        """Worker `index`'s scheduler; the first one's calls go to the sink (a subclass may record more)."""
        if self.sink is not None and index == 0:
            return RecordingScheduler(self.setup.base.config, limits, self.sink)
        return Scheduler(self.setup.base.config, limits)

    def _fleet_event(self, event: FleetEvent) -> None:
        if event.kind == "add":
            setup = self.setup
            cost = setup.role_costs.get(event.role, setup.base.cost)
            self._attach(event.role, cost, setup.role_jitters.get(event.role, setup.base.jitter))
            return
        worker = self.workers[event.worker]
        if not worker.alive:
            return
        worker.due.append(event)
        if not worker.scheduled:  # asleep: it is at a step boundary now
            worker.clock = max(worker.clock, self.now)
            self._events_due(worker)
            if worker.alive:
                self._wake(worker, worker.clock)  # a drain's first turn

    def _events_due(self, worker: SimWorker) -> None:
        for event in worker.due:
            if not worker.alive:
                break
            if event.kind == "kill":
                self._kill(worker)
            elif worker.drain_deadline is None:
                worker.drain_deadline = worker.clock + self.setup.drain_timeout_s
                self.fleet.leaving(worker)
        worker.due = []

    def _kill(self, worker: SimWorker) -> None:
        """The worker is lost: plans in flight with it; every live request continues on the heir
        from its last applied token, by recompute (core/handover.py)."""
        self._collect(worker)
        worker.alive = False
        worker.in_flight.clear()
        heir = self.router.successor(worker)
        self.router.detach(worker)
        self.fleet.gone(worker)
        live = [(r.rid, *continuation(r)) for r in worker.scheduler.live_requests()]
        self._give_away(worker, live, heir, f"worker {worker.worker} was killed")

    def _give_away(
        self,
        worker: SimWorker,
        live: list[tuple[str, list[int], RequestParams]],
        heir: SimWorker | None,
        why: str,
    ) -> None:
        arrivals, worker.arrivals = worker.arrivals, []
        orphans, worker.orphans = worker.orphans, []
        items = [_Orphan(r.rid, r.input_ids, r.params) for r in arrivals] + orphans
        items += [_Orphan(rid, ids, params) for rid, ids, params in live]
        for item in items:
            progress = self.progress[item.rid]
            if heir is None:
                progress.owner = None
                self._end(progress, worker.clock, "abort")
                continue
            self.handed_over += 1
            self.recomputed_tokens += len(item.input_ids) if progress.admitted is not None else 0
            self._adopt(heir, _Orphan(item.rid, item.input_ids, item.params), worker)
        del why

    def _adopt(self, heir: SimWorker, orphan: _Orphan, source: SimWorker | None) -> None:
        progress = self.progress[orphan.rid]
        if source is not None and progress.owner is source and not progress.moved:
            req = source.scheduler.requests.get(orphan.rid)
            if req is not None:
                progress.cached_tokens = req.cached_tokens
            progress.moved = True
        progress.owner = heir
        heir.orphans.append(orphan)
        self._wake(heir, self.now)

    def _leave_turn(self, worker: SimWorker) -> bool:
        """A turn of draining (core/drain.py's, on the simulated clock): True once it has left."""
        sched = worker.scheduler
        heir = self.router.successor(worker)
        if not worker.drain_begun:
            worker.drain_begun = True
            fresh = [
                r for r in sched.waiting if r.num_outputs == 0 and r.host_backup_len == 0 and r.handle < 0
            ]
            if heir is not None:
                moved = [(r.rid, *continuation(r)) for r in fresh]
                for rid, ids, params in moved:
                    self.handed_over += 1
                    self._adopt(heir, _Orphan(rid, ids, params), worker)
                for rid, _, _ in moved:
                    sched.abort(rid, HANDED_OVER)
        if self.setup.drain_migration and sched.requests:
            for move in self.fleet.drain(worker).moves:
                self._start_move(worker, move)
        assert worker.drain_deadline is not None
        if sched.requests and worker.clock >= worker.drain_deadline and heir is not None:
            self._collect(worker)
            live = [(r.rid, *continuation(r)) for r in sched.live_requests()]
            for rid, ids, params in live:
                self.handed_over += 1
                self.recomputed_tokens += len(ids)
                self._adopt(heir, _Orphan(rid, ids, params), worker)
            for rid, _, _ in live:
                sched.abort(rid, HANDED_OVER)
        if sched.requests or worker.in_flight or worker.transits or worker.orphans or worker.arrivals:
            return False
        worker.alive = False
        self.router.detach(worker)
        self.fleet.gone(worker)
        return True

    # --- requests arriving

    def _arrive(self, req: TraceRequest) -> None:
        """The request reaches the control plane's core: its quota is checked (the core's book, on
        the simulated clock), then the router picks its worker."""
        progress = _Progress(req.rid, req.arrival, len(req.input_ids), len(self.progress) + 1)
        self.progress[req.rid] = progress
        self.by_uid[progress.uid] = progress
        p = req.params
        if self.tenants is not None:
            self.tenants.arrived(req.rid, p.tenant, p.ttft_slo_ms, p.tpot_slo_ms)
        if self.quotas is not None:
            refusal = self.quotas.arrive(p.tenant, (progress.uid,), len(req.input_ids), self.now)
            if refusal is not None:
                self._end(progress, self.now, f"refused: {refusal.field}")
                return
        worker = self._route(req)
        if worker is None:
            self._refuse(progress, self.now, "no worker")
            return
        progress.owner = worker
        worker.arrivals.append(req)
        self._wake(worker, self.now)

    def _route(self, req: TraceRequest) -> SimWorker | None:
        return self.router.pick(
            req.params.routing_key, _ids(req.input_ids) if len(self.workers) > 1 else None
        )

    def _abort(self, rid: str) -> None:
        progress = self.progress.get(rid)
        if progress is None:
            return
        if progress.owner is None:
            progress.aborted = True  # moving: the abort takes effect where it lands
            return
        progress.owner.aborts.append(rid)

    def _wake(self, worker: SimWorker, when: float) -> None:
        if worker.scheduled or not worker.alive:
            return
        worker.clock = max(worker.clock, when)
        worker.scheduled = True
        self._at(worker.clock, _TURN, lambda: self._turn(worker))

    def _drain_inbox(self, worker: SimWorker) -> None:
        sched = worker.scheduler
        for req in worker.arrivals:
            progress = self.progress[req.rid]
            try:
                sched.add_request(req.rid, req.input_ids, req.params, progress.uid)
            except (QueueFull, RequestRejected, ValueError) as exc:
                self._refuse(progress, worker.clock, type(exc).__name__)
                continue
            if self.quotas is not None:
                self.quotas.accepted(progress.uid)
            progress.workers.append(worker.worker)
            worker.queued[req.rid] = worker.clock
        worker.arrivals = []
        for orphan in worker.orphans:
            progress = self.progress[orphan.rid]
            if orphan.transfer_id:
                worker.link.landed(orphan.transfer_id, len(orphan.tokens))
                sched.import_kv(orphan.transfer_id, orphan.tokens)
            try:
                sched.add_request(orphan.rid, orphan.input_ids, orphan.params, progress.uid)
            except (QueueFull, RequestRejected, ValueError):
                # Admitted once, so not a refusal: the live core ends it with an abort
                # (core/admission.py:admit_orphan), and an objective counts it as missed.
                self._end(progress, worker.clock, "abort")
                continue
            progress.workers.append(worker.worker)
            if progress.aborted:
                worker.aborts.append(orphan.rid)
        worker.orphans = []
        for rid in worker.aborts:
            sched.abort(rid, TRACE_ABORT)
        worker.aborts = []

    def _refuse(self, progress: _Progress, when: float, why: str) -> None:
        """Refused after its quota check passed (no worker, or its scheduler refused it): as the
        core's book has it, counted as rejected and its prompt back in the tenant's bucket."""
        if self.quotas is not None:
            self.quotas.refused(progress.uid, why)
        self._end(progress, when, f"refused: {why}")

    def _end(self, progress: _Progress, when: float, reason: str) -> None:
        """The request ended (finished, aborted or refused), wherever it ran: its tenant's
        concurrency is released."""
        if self.tenants is not None and progress.first_token is None and progress.finished is None:
            self.tenants.answered(progress.rid)
        progress.finished, progress.reason = when, reason
        if self.quotas is not None:
            self.quotas.ended(progress.uid)

    # --- a worker's turn: the single-worker simulator's step

    def _turn(self, worker: SimWorker) -> None:
        worker.scheduled = False
        if not worker.alive:
            return
        if worker.due:
            self._events_due(worker)
            if not worker.alive:
                return
        self._drain_inbox(worker)
        if worker.drain_deadline is not None and self._leave_turn(worker):
            return
        sched = worker.scheduler
        plan = sched.next_plan()
        if plan is not None and (self.tenants is not None or self.quotas is not None):
            self._planned(worker, plan)
        if worker.queued:
            self._admitted(worker)
        if worker.spill_to is not None and sched.emigrants:
            self._emigrate(worker)
        self._collect(worker)
        if plan is not None:
            if len(plan.extends):  # most plans only decode
                worker.prefill_tokens += int(plan.extends.lens.sum())
            result = self._execute(worker, plan)
            if result.error:
                raise RuntimeError(f"sim worker {worker.worker} failed step {plan.step_id}: {result.error}")
            worker.in_flight.append(result)
        elif not worker.in_flight:
            if sched.is_idle:
                sched.on_idle()
            self.end = max(self.end, worker.clock)
            return  # asleep until something comes
        if len(worker.in_flight) >= self.depth or plan is None:
            self._apply(worker, worker.in_flight.popleft())
        worker.scheduled = True
        self._at(worker.clock, _TURN, lambda: self._turn(worker))

    def _execute(self, worker: SimWorker, plan: StepPlan) -> StepResult:
        if self.setup.wire:
            return step_through_wire(worker.executor, plan)
        return worker.executor.execute(plan)

    def _apply(self, worker: SimWorker, result: StepResult) -> None:
        seconds = worker.jitter(self._step_seconds(worker, result))
        worker.clock += seconds
        worker.busy_s += seconds
        self.end = max(self.end, worker.clock)
        worker.scheduler.apply_result(result)
        worker._steps += 1
        self.steps += 1
        self._collect(worker)
        if len(self.workers) > 1:
            self._place(worker)
        if self.load_samples and worker.clock - self.load_samples[-1][0] < 1.0:
            return
        queued = sum(w.load()[0] for w in self.workers if w.alive)
        running = sum(w.load()[1] for w in self.workers if w.alive)
        self.load_samples.append((worker.clock, queued, running))

    def _step_seconds(self, worker: SimWorker, result: StepResult) -> float:
        """How far the step moves the worker's clock: its cost model's forward (a subclass may time
        it otherwise)."""
        del worker
        return result.forward_s

    def _planned(self, worker: SimWorker, plan: StepPlan) -> None:
        """The tenants' service and quotas: the plan's prompt tokens, and its first prefills no longer
        queued."""
        if self.tenants is not None:
            self.tenants.planned(plan, worker.clock, worker.worker)
        if self.quotas is not None:
            for seq in plan.new_seqs:
                self.quotas.admitted(self.progress[seq.request_id].uid)

    def _admitted(self, worker: SimWorker) -> None:
        waiting = {r.rid for r in worker.scheduler.waiting}
        for rid in [rid for rid in worker.queued if rid not in waiting]:
            progress = self.progress[rid]
            if progress.admitted is None:
                progress.admitted = worker.clock
            del worker.queued[rid]

    def _collect(self, worker: SimWorker) -> None:
        updates = worker.scheduler.take_updates()
        if updates.empty:  # asked twice a turn, mostly for nothing
            return
        by_uid = self.by_uid
        published = self.setup.base.client.published(worker.clock)
        tenants = self.tenants
        uids = updates.tokens.uids.tolist()
        for uid in uids:  # a few per step: plain ints beat np.unique
            progress = by_uid[uid]
            if progress.owner is not worker:
                continue
            if progress.first_token is None:
                progress.first_token = published
                if tenants is not None:
                    tenants.answered(progress.rid)
            progress.output_tokens += 1
            if tenants is not None:
                tenants.output(progress.rid, 1, worker.clock)
        if self.quotas is not None:
            self.quotas.tokens([uid for uid in uids if by_uid[uid].owner is worker], worker.clock)
        for finished in updates.finished:
            progress = self.progress[finished.rid]
            if progress.owner is not worker:
                continue
            self._end(progress, published, finished.reason.kind.value)
            if not progress.moved:
                progress.cached_tokens = finished.cached_tokens

    # --- moves: the fleet decides, the twin moves

    def _place(self, worker: SimWorker) -> None:
        plan = self.fleet.place(worker, self.setup.rules)
        if plan.spill is not None:
            self._spill(worker, plan.spill)
        for move in plan.moves:
            self._start_move(worker, move)

    def _spill(self, worker: SimWorker, spill: Spill) -> None:
        if spill.to is None and worker.spill_to is None:
            return
        target = self.fleet.member(spill.to) if spill.to is not None and spill.tokens > 0 else None
        worker.spill_to = target.worker if target is not None else None
        address = target.limits.transfer_address if target is not None else ""
        worker.scheduler.spill_to(address, spill.tokens)

    def _emigrate(self, worker: SimWorker) -> None:
        """The latest plan sent retraction victims to the spill worker: each continues there."""
        target = self.fleet.member(worker.spill_to) if worker.spill_to is not None else None
        for emigrant in worker.scheduler.emigrants:
            req = emigrant.req
            ids, params = continuation(req)
            self._depart(worker, req, ids, params, emigrant.transfer_id, emigrant.tokens, target, "kv")

    def _start_move(self, worker: SimWorker, move: Move) -> bool:
        """The engine's start_move, as one stop-and-copy: the call finishes here (its KV cached and
        sent) and continues at the destination once the copy's bytes have crossed the link."""
        destination = self.fleet.member(move.to)
        sched = worker.scheduler
        if destination is None or not destination.serving:
            return False
        reqs = [sched.running_request(rid) for rid in move.rids]
        if any(r is None or r.rid in worker.transits for r in reqs):
            return False
        self._collect(worker)  # their tokens so far first
        for req in reqs:
            assert req is not None
            ids, params = continuation(req)
            transfer_id = f"{worker.worker}/{next(self._transfers)}"
            slots = sched.export(req.rid, MIGRATED, transfer_id, destination.limits.transfer_address)
            assert slots is not None
            sent = transfer_id if len(slots) else ""
            self._depart(worker, req, ids, params, sent, ids[: len(slots)], destination, move.reason)
        self.fleet.started(move.to)
        return True

    def _depart(
        self,
        worker: SimWorker,
        req: Request,
        ids: list[int],
        params: RequestParams,
        transfer_id: str,
        tokens: Sequence[int],
        destination: SimWorker | None,
        reason: str,
    ) -> None:
        """`req` left `worker` for `destination` (None: nowhere to go, it ends)."""
        rid = req.rid
        progress = self.progress[rid]
        if not progress.moved:
            progress.cached_tokens = req.cached_tokens  # the prompt's own hit, before any move
            progress.moved = True
        progress.owner = None
        self.migrations[reason] += 1
        if destination is None:
            self._end(progress, worker.clock, "abort")
            return
        nbytes = len(tokens) * self.setup.kv_bytes_per_token
        self.migrated_bytes += nbytes
        seconds = nbytes / (self.setup.link_gbps * 1e9)
        worker.transits[rid] = _Transit(worker.worker, destination.worker, reason)
        orphan = _Orphan(rid, ids, params, transfer_id, tuple(tokens) if transfer_id else ())
        self._at(worker.clock + seconds, _LAND, lambda: self._land(worker, destination, orphan))

    def _land(self, source: SimWorker, destination: SimWorker, orphan: _Orphan) -> None:
        del source.transits[orphan.rid]
        if source.alive and not source.scheduled:
            self._wake(source, self.now)  # a draining source may be done now
        if not destination.serving or not source.alive:
            # The destination left, or the source was lost mid-copy (the copy dies with it, as
            # migration.py's `lost`): the call recomputes on an heir.
            if not destination.serving:
                self.fleet.moved(destination.worker, False)
            self.migration_fallbacks += 1
            heir = self.router.successor(destination if source.alive else source)
            if heir is None:
                self._end(self.progress[orphan.rid], self.now, "abort")
                return
            self.recomputed_tokens += len(orphan.input_ids)
            self._adopt(heir, _Orphan(orphan.rid, orphan.input_ids, orphan.params), None)
            return
        self.fleet.moved(destination.worker, True)
        self._adopt(destination, orphan, None)

    # --- the report

    def summary(self) -> dict[str, object]:
        """The single-worker simulator's summary, over the whole fleet."""
        retractions = sum(w.scheduler.num_retracted_total for w in self.workers)
        summary = summarize(self.progress.values(), self.steps, self.end, retractions)
        if self.tenants is not None:
            summary.update(self.tenants.summary(self.progress, self.end))
        return summary


def _ids(input_ids: Sequence[int]) -> np.ndarray:
    return np.asarray(input_ids, dtype=np.int64)
