"""Factories for scheduler tests: build a scheduler, requests, and drive it against a FakeWorker."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from control_plane.cache.invariants import check_pool_invariants
from control_plane.config import SchedulerConfig, validate_scheduler_config
from control_plane.request import FinishReason, RequestParams, SamplerSpec
from control_plane.scheduler.plan import StepPlan, WorkerLimits
from control_plane.scheduler.scheduler import Scheduler
from tests.control_plane.fake_worker import FakeWorker

EOS = 2


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
    return RequestParams(max_new_tokens=max_new_tokens, sampler=SamplerSpec(temperature=0.0), **kw)  # type: ignore[arg-type]


def prompt(n: int, seed: int = 0) -> list[int]:
    """n token ids in [10, 900), distinct per seed."""
    return [10 + (seed * 7919 + i * 104729) % 890 for i in range(n)]


@dataclass
class Outcome:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, FinishReason] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)
    steps: int = 0


def check_books(sched: Scheduler, worker: FakeWorker, report: tuple[int, int]) -> None:
    check_pool_invariants(sched.kv.allocator, sched.kv.tree, sched.private_slots())
    assert report == (len(worker.seqs), sum(len(s.slots) for s in worker.seqs.values()))


def run(
    sched: Scheduler,
    worker: FakeWorker,
    arrivals: Sequence[tuple[int, str, list[int], RequestParams]] = (),
    max_steps: int = 10_000,
    on_step: Callable[[Scheduler, int], None] | None = None,
) -> Outcome:
    """Feed arrivals (step, rid, prompt, params) and step until idle; checks invariants every step."""
    out = Outcome()
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while step < max_steps:
        while pending and pending[0][0] <= step:
            _, rid, ids, p = pending.pop(0)
            out.tokens[rid] = []
            sched.add_request(rid, ids, p)
        if on_step is not None:
            on_step(sched, step)
        _collect(sched, out)
        plan = sched.next_plan()
        _collect(sched, out)
        if plan is None:
            if not pending:
                break
            step += 1
            continue
        expected = (sched.live_handles(), sched.live_seq_slots() + len(plan.decodes))
        result = worker.run(plan)
        assert (result.kv.live_seqs, result.kv.seq_slots) == expected, (plan.step_id, expected, result.kv)
        sched.apply_result(result)
        _collect(sched, out)
        check_pool_invariants(sched.kv.allocator, sched.kv.tree, sched.private_slots())
        out.plans.append(plan)
        step += 1
    out.steps = step
    return out


def _collect(sched: Scheduler, out: Outcome) -> None:
    for update in sched.take_updates():
        out.tokens.setdefault(update.rid, []).extend(update.token_ids)
        if update.finished is not None:
            assert update.rid not in out.finished, f"{update.rid} finished twice"
            out.finished[update.rid] = update.finished
