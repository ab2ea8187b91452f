"""Factories for scheduler tests: build a scheduler, requests, and drive it against a FakeWorker."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from control_plane.cache.invariants import check_pool_invariants
from control_plane.config import SchedulerConfig, validate_scheduler_config
from control_plane.request import FinishReason, Request, RequestParams
from control_plane.scheduler.records import PromptScoring
from control_plane.scheduler.scheduler import Scheduler, StepUpdates
from protos.worker import SamplerParams, StepPlan, StepResult, TokenLogprobs, WorkerLimits
from tests.control_plane.fake_worker import FakeWorker

EOS = 2
# Plans a driver keeps in flight in overlap mode (the engine's two; the scheduler does not limit it).
OVERLAP_DEPTH = 2
_RIDS: dict[int, str] = {}


def uid_of(rid: str) -> int:
    """A stable uid per request id (an unsigned 64-bit hash), remembered for `by_rid`."""
    uid = int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little")
    _RIDS[uid] = rid
    return uid


def add(sched: Scheduler, rid: str, ids: Sequence[int], p: RequestParams) -> Request:
    """add_request with the rid's uid, so that `by_rid` can name the streamed tokens."""
    return sched.add_request(rid, ids, p, uid=uid_of(rid))


def by_rid(updates: StepUpdates) -> dict[str, list[int]]:
    """Streamed tokens per request id, in order (requests added through `add`)."""
    out: dict[str, list[int]] = {}
    tokens = updates.tokens
    for uid, token in zip(tokens.uids.tolist(), tokens.token_ids.tolist(), strict=True):
        out.setdefault(_RIDS[uid], []).append(token)
    return out


def finishes(updates: StepUpdates) -> dict[str, FinishReason]:
    return {f.rid: f.reason for f in updates.finished}


def make_config(**changes: object) -> SchedulerConfig:
    config = dataclasses.replace(SchedulerConfig(), **changes)  # type: ignore[arg-type]
    validate_scheduler_config(config)
    return config


def make_scheduler(
    capacity: int = 4096, page_size: int = 1, max_context: int = 2048, host_pool: int = 0, **config: object
) -> Scheduler:
    limits = WorkerLimits(
        worker_id="w0",
        kv_capacity_tokens=capacity,
        page_size=page_size,
        max_context=max_context,
        vocab_size=1000,
        eos_token_ids=frozenset({EOS}),
        host_pool_capacity_tokens=host_pool,
    )
    return Scheduler(make_config(**config), limits)


def params(max_new_tokens: int | None = 16, **kw: object) -> RequestParams:
    return RequestParams(max_new_tokens=max_new_tokens, sampler=SamplerParams(temperature=0.0), **kw)  # type: ignore[arg-type]


def prompt(n: int, seed: int = 0) -> list[int]:
    """n token ids in [10, 900), distinct per seed."""
    return [10 + (seed * 7919 + i * 104729) % 890 for i in range(n)]


@dataclass
class Outcome:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, FinishReason] = field(default_factory=dict)
    # Per request: the logprobs streamed with its tokens, and its published prompt scoring.
    scores: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_scores: dict[str, PromptScoring] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)
    steps: int = 0

    def decodes(self) -> Counter[str]:
        """Decode entries naming each request over all plans (dead decodes included)."""
        rid_of: dict[int, str] = {}
        counts: Counter[str] = Counter()
        for plan in self.plans:
            rid_of.update((seq.handle, seq.request_id) for seq in plan.new_seqs)
            counts.update(rid_of[h] for h in plan.decodes.handles.tolist())
        return counts


def check_pool(sched: Scheduler) -> None:
    check_pool_invariants(sched.kv.allocator, sched.kv.tree, sched.private_slots())


def run_plan(sched: Scheduler, worker: FakeWorker, plan: StepPlan) -> StepResult:
    """The worker runs `plan`; its report must match the books taken right after planning."""
    books = sched.books()
    result = worker.run(plan)
    assert (result.kv.live_seqs, result.kv.seq_slots) == books, (plan.step_id, books, result.kv)
    return result


def run(
    sched: Scheduler,
    worker: FakeWorker,
    arrivals: Sequence[tuple[int, str, list[int], RequestParams]] = (),
    max_steps: int = 10_000,
    on_step: Callable[[Scheduler, int], None] | None = None,
    overlap: bool = False,
    depth: int = OVERLAP_DEPTH,
    react: Callable[[Scheduler, Outcome], None] | None = None,
) -> Outcome:
    """Feed arrivals (step, rid, prompt, params) and step until idle; checks the books and the pool
    invariants every step. With `overlap`, plan N+1 is made (and run by the worker) before plan N's
    result is applied, as SGLang's overlap loop does (`depth` plans in flight at most). `react` runs
    right after each result's updates are collected, as the engine publishes (and may finish a
    request for a stop string) before it plans again."""
    out = Outcome()
    pending = sorted(arrivals, key=lambda a: a[0])
    in_flight: deque[StepResult] = deque()
    depth = depth if overlap else 1
    step = 0
    while step < max_steps:
        while pending and pending[0][0] <= step:
            _, rid, ids, p = pending.pop(0)
            out.tokens[rid] = []
            add(sched, rid, ids, p)
        if on_step is not None:
            on_step(sched, step)
        _collect(sched, out)
        plan = sched.next_plan()
        _collect(sched, out)
        if plan is None and not in_flight:
            if not pending:
                break
            step += 1
            continue
        if plan is not None:
            in_flight.append(run_plan(sched, worker, plan))
            out.plans.append(plan)
            check_pool(sched)
        if len(in_flight) >= depth or plan is None:
            sched.apply_result(in_flight.popleft())
            _collect(sched, out)
            if react is not None:
                react(sched, out)
                _collect(sched, out)
            check_pool(sched)
        step += 1
    assert not in_flight or step >= max_steps
    out.steps = step
    return out


def _collect(sched: Scheduler, out: Outcome) -> None:
    updates = sched.take_updates()
    for scoring in updates.prompt_scores:
        rid = _RIDS[scoring.uid]
        assert rid not in out.prompt_scores, f"{rid}: prompt scores published twice"
        assert not out.tokens.get(rid), f"{rid}: prompt scores after its first token"
        out.prompt_scores[rid] = scoring
    tokens = updates.tokens
    for k, lp in tokens.scores:
        out.scores.setdefault(_RIDS[int(tokens.uids[k])], []).append(lp)
    for rid, tokens in by_rid(updates).items():
        assert rid not in out.finished, f"{rid} streamed after its finish"
        out.tokens.setdefault(rid, []).extend(tokens)
    for f in updates.finished:
        assert f.rid not in out.finished, f"{f.rid} finished twice"
        out.finished[f.rid] = f.reason
