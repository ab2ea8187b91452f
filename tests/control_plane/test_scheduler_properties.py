"""Property tests: random traces and configs against the slot-checking fake worker (SCHEDULER.md §0.1,
§4, §6, §7, §12). After every step `run` checks the pool invariants and the worker's report."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.request import AbortCode, FinishKind, RequestParams
from control_plane.scheduler.plan import StepPlan
from control_plane.scheduler.scheduler import OOM_LAST_REQUEST, Scheduler, clamp_max_new_tokens
from tests.control_plane.factories import EOS, FakeWorker, Outcome, make_scheduler, params, prompt, run

PREFIXES = [prompt(120, seed=s) for s in (101, 102, 103)]
Arrival = tuple[int, str, list[int], RequestParams]


@dataclass(frozen=True)
class Setup:
    capacity: int
    page_size: int
    chunk: int | None
    radix: bool
    test_retract: bool
    policy: str
    mixed: bool
    eos_every: int

    def scheduler(self) -> Scheduler:
        return make_scheduler(
            capacity=self.capacity,
            page_size=self.page_size,
            chunked_prefill_size=self.chunk,
            disable_radix_cache=not self.radix,
            test_retract=self.test_retract,
            schedule_policy=self.policy,
            enable_mixed_chunk=self.mixed,
            max_prefill_tokens=256,
        )


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    page = draw(st.sampled_from([1, 4]))
    chunk = draw(st.sampled_from([None, 16, 32, 64]))
    return Setup(
        capacity=draw(st.integers(40, 160)) * 4,
        page_size=page,
        chunk=chunk,
        radix=draw(st.booleans()),
        test_retract=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "lpm", "dfs-weight", "lof", "random", "routing-key"])),
        mixed=chunk is not None and draw(st.booleans()),
        eos_every=draw(st.sampled_from([0, 0, 7, 25])),
    )


@st.composite
def traces(draw: st.DrawFn) -> list[Arrival]:
    n = draw(st.integers(1, 10))
    out = []
    for i in range(n):
        shared = draw(st.sampled_from([0, 0, 20, 40, 100]))
        prefix = PREFIXES[draw(st.integers(0, 2))][:shared]
        ids = prefix + prompt(draw(st.integers(1, 80)), seed=i)
        p = params(
            draw(st.integers(1, 60)), ignore_eos=draw(st.booleans()), routing_key=draw(st.sampled_from("ab"))
        )
        out.append((draw(st.integers(0, 25)), f"r{i}", ids, p))
    return out


def plan_key(plan: StepPlan) -> tuple[object, ...]:
    ext, dec = plan.extends, plan.decodes
    return (
        plan.kind,
        plan.releases.tolist(),
        [(s.handle, s.prefix_slots.tolist()) for s in plan.new_seqs],
        [(r.handle, r.start, r.slots.tolist()) for r in plan.remaps],
        ext.handles.tolist(),
        ext.starts.tolist(),
        ext.lens.tolist(),
        ext.sample.tolist(),
        ext.token_ids.tolist(),
        ext.slots.tolist(),
        dec.handles.tolist(),
        dec.slots.tolist(),
    )


def run_setup(setup: Setup, trace: list[Arrival]) -> tuple[Scheduler, Outcome]:
    sched = setup.scheduler()
    worker = FakeWorker(setup.capacity, eos=EOS, eos_every=setup.eos_every)
    return sched, run(sched, worker, trace, max_steps=5000)


def reference(trace: list[Arrival], eos_every: int, clamp_like: Scheduler | None = None) -> Outcome:
    """The same requests on a big pool without chunking; with `clamp_like`, max_new_tokens as that
    scheduler clamped them at intake (§1.5: the clamp depends on the pool size)."""
    if clamp_like is not None:
        trace = [(t, rid, ids, clamped(clamp_like, ids, p)) for t, rid, ids, p in trace]
    sched = make_scheduler(capacity=1 << 14, chunked_prefill_size=None)
    return run(sched, FakeWorker(1 << 14, eos=EOS, eos_every=eos_every), trace)


def clamped(sched: Scheduler, ids: list[int], p: RequestParams) -> RequestParams:
    limit = clamp_max_new_tokens(
        p.max_new_tokens, len(ids), sched.max_req_len, sched.capacity, sched.page_size, None
    )
    return dataclasses.replace(p, max_new_tokens=limit)


def assert_nothing_leaked(sched: Scheduler) -> None:
    kv = sched.kv
    assert sched.is_idle and sched.chunked_req is None
    assert kv.available_size() + kv.evictable_size() == sched.capacity
    assert kv.protected_size() == 0 and sched.live_handles() == 0
    assert kv.free_rows() == sched.max_running_requests


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), trace=traces())
def test_random_traces_keep_the_books_and_the_outputs(setup: Setup, trace: list[Arrival]) -> None:
    sched, out = run_setup(setup, trace)
    assert set(out.finished) == {rid for _, rid, _, _ in trace}
    assert_nothing_leaked(sched)
    expected = reference(trace, setup.eos_every, clamp_like=sched)
    for rid, reason in out.finished.items():
        if reason.kind is FinishKind.ABORT:
            # Only a prompt too long for this pool, or the last request out of memory (§1.5, §6.3).
            assert reason.code is AbortCode.INVALID or reason.message == OOM_LAST_REQUEST, (rid, reason)
            continue
        assert out.tokens[rid] == expected.tokens[rid], rid
        assert reason == expected.finished[rid], rid


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), trace=traces())
def test_same_input_same_plans(setup: Setup, trace: list[Arrival]) -> None:
    _, first = run_setup(setup, trace)
    _, second = run_setup(setup, trace)
    assert [plan_key(p) for p in first.plans] == [plan_key(p) for p in second.plans]
    assert first.tokens == second.tokens


def test_pressure_forces_real_retractions() -> None:
    """A fixed trace under which the pool fills up: retraction and re-prefill keep outputs unchanged."""
    trace = [(3 * i, f"r{i}", PREFIXES[i % 2][:40] + prompt(30, seed=i), params(90)) for i in range(8)]
    setup = Setup(
        capacity=256,
        page_size=4,
        chunk=32,
        radix=True,
        test_retract=False,
        policy="lpm",
        mixed=False,
        eos_every=0,
    )
    sched, out = run_setup(setup, trace)
    assert sched.num_retracted_total > 0
    assert_nothing_leaked(sched)
    assert out.tokens == reference(trace, 0).tokens


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    setup=setups(),
    trace=traces(),
    priorities=st.lists(st.integers(0, 40), min_size=10, max_size=10),
    max_running=st.integers(1, 3),
    low_first=st.booleans(),
    by_priority=st.booleans(),
)
def test_priority_preemption_keeps_the_books_and_the_outputs(
    setup: Setup,
    trace: list[Arrival],
    priorities: list[int],
    max_running: int,
    low_first: bool,
    by_priority: bool,
) -> None:
    trace = [
        (t, rid, ids, dataclasses.replace(p, priority=priorities[i]))
        for i, (t, rid, ids, p) in enumerate(trace)
    ]
    sched = make_scheduler(
        capacity=setup.capacity,
        page_size=setup.page_size,
        chunked_prefill_size=setup.chunk,
        disable_radix_cache=not setup.radix,
        test_retract=setup.test_retract,
        enable_mixed_chunk=setup.mixed,
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=low_first,
        retraction_policy="priority" if by_priority else "length",
        max_running_requests=max_running,
    )
    out = run(sched, FakeWorker(setup.capacity, eos=EOS, eos_every=setup.eos_every), trace, max_steps=5000)
    assert set(out.finished) == {rid for _, rid, _, _ in trace}
    assert_nothing_leaked(sched)
    expected = reference(trace, setup.eos_every, clamp_like=sched)
    for rid, reason in out.finished.items():
        if reason.kind is FinishKind.ABORT:
            assert reason.code is AbortCode.INVALID or reason.message == OOM_LAST_REQUEST, (rid, reason)
            continue
        assert out.tokens[rid] == expected.tokens[rid], rid
