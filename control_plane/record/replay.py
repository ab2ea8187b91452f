"""Replays of a recording: recorded calls into a fresh scheduler, or recorded plans into a worker.

Both report the first divergence (the step, the field, both values) or that the replay was
identical. Scheduler replay feeds every recorded call in order and compares each plan it makes,
each call's outcome and each finish with the record. Worker replay sends each recorded plan to a
step function (a fresh worker, composed by the caller) and compares its results with the record.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from control_plane.record.entries import (
    Abort,
    AddRequest,
    ApplyResult,
    Entry,
    Export,
    Finish,
    Finished,
    Header,
    ImportKv,
    NextPlan,
    OnIdle,
    SendKv,
    SpillTo,
)
from control_plane.request import FinishReason
from control_plane.scheduler.scheduler import QueueFull, RequestRejected, Scheduler
from protos.worker import KvReport, StepPlan, StepResult


@dataclass(frozen=True, slots=True)
class Divergence:
    step: int
    field: str
    recorded: str
    replayed: str

    def describe(self) -> str:
        return f"step {self.step}: {self.field} differs: recorded {self.recorded}, replayed {self.replayed}"


@dataclass(frozen=True, slots=True)
class ReplayReport:
    divergence: Divergence | None
    # What was replayed, by kind ("plans", "results", "arrivals", ...).
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.divergence is None

    def describe(self) -> str:
        counts = ", ".join(f"{n} {what}" for what, n in sorted(self.counts.items()))
        if self.divergence is None:
            return f"identical: {counts}"
        return f"diverged at {self.divergence.describe()} (after {counts})"


# --- field-by-field comparison -------------------------------------------------------------------


def first_difference(recorded: object, replayed: object, path: str = "") -> tuple[str, str, str] | None:
    """(field path, recorded, replayed) of the first differing leaf of two values, or None."""
    if isinstance(recorded, np.ndarray) or isinstance(replayed, np.ndarray):
        return _array_difference(np.asarray(recorded), np.asarray(replayed), path)
    if dataclasses.is_dataclass(recorded) and type(recorded) is type(replayed):
        for f in dataclasses.fields(recorded):
            name = f"{path}.{f.name}" if path else f.name
            found = first_difference(getattr(recorded, f.name), getattr(replayed, f.name), name)
            if found:
                return found
        return None
    if isinstance(recorded, tuple | list) and isinstance(replayed, tuple | list):
        if len(recorded) != len(replayed):
            return f"len({path})", str(len(recorded)), str(len(replayed))
        for i, (a, b) in enumerate(zip(recorded, replayed, strict=True)):
            found = first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if recorded == replayed else (path, repr(recorded), repr(replayed))


def _array_difference(a: np.ndarray, b: np.ndarray, path: str) -> tuple[str, str, str] | None:
    if a.shape != b.shape:
        return f"len({path})", str(len(a)), str(len(b))
    differs = np.flatnonzero(a.astype(np.int64) != b.astype(np.int64))
    if not differs.size:
        return None
    i = int(differs[0])
    return f"{path}[{i}]", str(a[i].item()), str(b[i].item())


# --- scheduler replay ------------------------------------------------------------------------------


class _SchedulerReplay:
    """Feeds recorded calls to a fresh scheduler; `feed` returns the first divergence it finds."""

    def __init__(self, header: Header) -> None:
        self.scheduler = Scheduler(header.scheduler, header.limits)
        self.finishes: deque[tuple[str, FinishReason]] = deque()
        self.counts: Counter[str] = Counter()

    def feed(self, entry: Entry) -> Divergence | None:
        found = self._dispatch(entry)
        for finished in self.scheduler.take_updates().finished:
            self.finishes.append((finished.rid, finished.reason))
        return found

    def _dispatch(self, entry: Entry) -> Divergence | None:
        match entry:
            case AddRequest():
                return self._add_request(entry)
            case Abort():
                self.counts["aborts"] += 1
                applied = self.scheduler.abort(entry.rid, entry.reason)
                return _outcome(entry.step, f"abort({entry.rid}).applied", entry.applied, applied)
            case Finish():
                self.counts["finishes"] += 1
                applied = self.scheduler.finish(entry.rid, entry.reason)
                return _outcome(entry.step, f"finish({entry.rid}).applied", entry.applied, applied)
            case NextPlan():
                return self._next_plan(entry)
            case ApplyResult():
                self.counts["results"] += 1
                self.scheduler.apply_result(entry.result)
            case OnIdle():
                self.scheduler.on_idle()
            case Export():
                self.counts["exports"] += 1
                slots = self.scheduler.export(
                    entry.rid, entry.reason, entry.transfer_id, entry.address, entry.start
                )
                replayed = None if slots is None else tuple(slots.tolist())
                return _outcome(entry.step, f"export({entry.rid})", entry.slots, replayed)
            case SendKv():
                self.counts["pre-copies"] += 1
                tokens = self.scheduler.send_kv(entry.rid, entry.transfer_id, entry.address)
                return _outcome(entry.step, f"send_kv({entry.rid})", entry.tokens, tokens)
            case SpillTo():
                self.scheduler.spill_to(entry.address, entry.tokens)
            case ImportKv():
                self.counts["imports"] += 1
                outcome = self.scheduler.import_kv(
                    entry.transfer_id, entry.input_ids, entry.start, entry.hold
                )
                replayed_import = None if outcome is None else (outcome[0], tuple(outcome[1].tolist()))
                return _outcome(entry.step, f"import_kv({entry.transfer_id})", entry.outcome, replayed_import)
            case Finished():
                return self._finished(entry)
        return None

    def _add_request(self, entry: AddRequest) -> Divergence | None:
        self.counts["arrivals"] += 1
        try:
            self.scheduler.add_request(entry.rid, entry.input_ids, entry.params)
            error = ""
        except (QueueFull, RequestRejected, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        return _outcome(entry.step, f"add_request({entry.rid}).error", entry.error, error)

    def _next_plan(self, entry: NextPlan) -> Divergence | None:
        plan = self.scheduler.next_plan(entry.always)
        step = entry.plan.step_id if entry.plan is not None else entry.step + 1
        if (plan is None) != (entry.plan is None):
            return Divergence(step, "plan", _plan_word(entry.plan), _plan_word(plan))
        if plan is None or entry.plan is None:
            return None
        self.counts["plans"] += 1
        found = first_difference(entry.plan, plan, "plan")
        return Divergence(step, *found) if found else None

    def _finished(self, entry: Finished) -> Divergence | None:
        self.counts["finished"] += 1
        recorded = (entry.rid, entry.reason)
        replayed = self.finishes.popleft() if self.finishes else None
        if replayed == recorded:
            return None
        return Divergence(entry.step, "finished", repr(recorded), repr(replayed))


def _outcome(step: int, name: str, recorded: object, replayed: object) -> Divergence | None:
    return None if recorded == replayed else Divergence(step, name, repr(recorded), repr(replayed))


def _plan_word(plan: StepPlan | None) -> str:
    return "no plan" if plan is None else f"plan {plan.step_id}"


def _split_header(entries: Iterable[Entry]) -> tuple[Header, Iterator[Entry]]:
    it = iter(entries)
    header = next(it, None)
    if not isinstance(header, Header):
        raise ValueError("a recording starts with a header")
    return header, it


def replay_scheduler(entries: Iterable[Entry]) -> ReplayReport:
    """Feed a recording's calls into a fresh Scheduler; the first plan, outcome or finish that differs."""
    header, rest = _split_header(entries)
    replay = _SchedulerReplay(header)
    for entry in rest:
        divergence = replay.feed(entry)
        if divergence is not None:
            return ReplayReport(divergence, dict(replay.counts))
    return ReplayReport(None, dict(replay.counts))


# --- worker replay ---------------------------------------------------------------------------------

StepFn = Callable[[StepPlan], StepResult]


def comparable_result(result: StepResult) -> StepResult:
    """What must replay exactly: step id, tokens, the KV report (not timing, memory or log
    probabilities, whose float sums may differ across machines, nor which result carries a KV
    copy's outcome: that depends on when the bytes arrived)."""
    kv = dataclasses.replace(result.kv, device_mem_used_bytes=0) if result.kv else KvReport()
    return dataclasses.replace(
        result, kv=kv, forward_s=0.0, wait_s=0.0, logprobs=(), prompt_scores=(), transfers=()
    )


def replay_worker(entries: Iterable[Entry], step: StepFn) -> ReplayReport:
    """Run every recorded plan through `step` and compare each result with the recorded one.

    Plans run in recorded order; results are matched oldest first (under overlap a recording holds
    plan N+1 before result N)."""
    return replay_workers([entries], [step], lambda _transfer_id: True)[0]


class _WorkerReplay:
    """One recording's worker replay, an entry at a time."""

    def __init__(self, entries: Iterable[Entry], step: StepFn) -> None:
        _header, self._rest = _split_header(entries)
        self._step = step
        self._next: Entry | None = None
        self.done = False
        self.counts: Counter[str] = Counter()
        self._pending: deque[StepResult] = deque()
        self.divergence: Divergence | None = None

    def peek(self) -> Entry | None:
        if self._next is None and not self.done:
            self._next = next(self._rest, None)
            self.done = self._next is None
        return self._next

    def advance(self) -> None:
        entry, self._next = self._next, None
        if isinstance(entry, NextPlan) and entry.plan is not None:
            self._pending.append(self._step(entry.plan))
            self.counts["plans"] += 1
        elif isinstance(entry, ApplyResult) and self._pending:
            self.counts["results"] += 1
            replayed = self._pending.popleft()
            found = first_difference(comparable_result(entry.result), comparable_result(replayed), "result")
            if found:
                self.divergence = Divergence(entry.result.step_id, *found)

    def waiting_for(self, holds: Callable[[str], bool]) -> str | None:
        """The transfer the next plan receives that no replayed plan has sent yet (None: it can run)."""
        entry = self.peek()
        if not isinstance(entry, NextPlan) or entry.plan is None:
            return None
        return next(
            (r.transfer_id for r in entry.plan.receives if len(r.slots) and not holds(r.transfer_id)), None
        )


def replay_workers(
    recordings: Sequence[Iterable[Entry]], steps: Sequence[StepFn], holds: Callable[[str], bool]
) -> list[ReplayReport]:
    """Worker replay of recordings made together: the workers of one control plane that moved KV
    between them (docs/migration.md). Each recording's plans run through its own step function, and
    the recordings are interleaved so that a plan that receives a transfer runs once the plan that
    sent it has (`holds(transfer_id)`: the replayed workers hold it). A receive no recording sends
    is a divergence of that recording."""
    replays = [_WorkerReplay(entries, step) for entries, step in zip(recordings, steps, strict=True)]
    progressed = True
    while progressed and any(r.divergence is None for r in replays):
        progressed = False
        for replay in replays:
            while (
                replay.divergence is None and replay.peek() is not None and replay.waiting_for(holds) is None
            ):
                replay.advance()
                progressed = True
    for replay in replays:
        transfer = replay.waiting_for(holds) if replay.divergence is None else None
        if transfer is not None:
            entry = replay.peek()
            assert isinstance(entry, NextPlan) and entry.plan is not None
            replay.divergence = Divergence(
                entry.plan.step_id,
                "plan.receives",
                f"transfer {transfer!r} from another worker",
                "no recording given sends it (replay the recordings of every worker it moved KV with)",
            )
    return [ReplayReport(r.divergence, dict(r.counts)) for r in replays]
