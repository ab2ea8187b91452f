"""Forgetting idle tenants' counters (docs/scheduler.md#fairness): without API keys a caller may
name any tenant, so the table of counters must not keep one entry per name ever seen; forgetting
must not change a decision."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.scheduler.scheduler import Scheduler
from tests.control_plane.factories import make_scheduler, params, prompt, run
from tests.control_plane.fake_worker import FakeWorker


def _drive(
    sched: Scheduler, arrivals: list[tuple[int, str, str, int, int]], sweep_always: bool = False
) -> tuple[list[tuple[object, ...]], int]:
    """Arrivals (step, rid, tenant, prompt, output) fed as the steps come, then run until idle
    (`sweep_always`: the table swept at every join). Returns each plan's decisions (kind, its
    extends and their ranges, its decodes) and the most counters the table held."""
    worker = FakeWorker(sched.capacity)
    pending = sorted(arrivals)
    plans: list[tuple[object, ...]] = []
    most = 0
    step = 0
    counters = sched.fairness
    assert counters is not None
    while pending or not sched.is_idle:
        while pending and pending[0][0] <= step:
            _, rid, tenant, n, out = pending.pop(0)
            if sweep_always:
                counters.forget_at = 0
            sched.add_request(rid, prompt(n, hash(rid) % 1000), params(out, tenant=tenant, ignore_eos=True))
        plan = sched.next_plan()
        batch = sched.last_batch
        if plan is not None:
            if batch is not None:
                plans.append(
                    (
                        batch.kind,
                        tuple((r.rid, r.extend_range) for r in batch.extend_reqs),
                        tuple(r.rid for r in batch.decode_reqs),
                    )
                )
            sched.apply_result(worker.run(plan))
        most = max(most, len(counters.counters))
        step += 1
        assert step < 200_000
    return plans, most


def test_twenty_thousand_made_up_tenants_leave_a_bounded_table() -> None:
    """Each caller names a new tenant for its one request, 16 a step (each done in its prefill
    step): the table holds the tenants live and those whose counters still carry something, not the
    20,000 names."""
    arrivals = [(i // 16, f"r{i}", f"made-up-{i}", 4, 1) for i in range(20_000)]
    sched = make_scheduler(fairness="vtc", chunked_prefill_size=None)
    _, most = _drive(sched, arrivals)
    assert sched.fairness is not None
    assert most <= 200
    assert len(sched.fairness.counters) <= 200


TRAFFIC = st.lists(
    st.tuples(
        st.integers(0, 80),  # arrival step
        st.integers(0, 11),  # tenant
        st.integers(3, 40),  # prompt
        st.integers(1, 30),  # output
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=30, deadline=None)
@given(TRAFFIC, st.booleans(), st.sampled_from([0.0, 20.0]))
def test_forgetting_changes_no_decision(
    traffic: list[tuple[int, int, int, int]], overlap: bool, bound: float
) -> None:
    """The same traffic with a sweep at every new tenant and with none: the same plans, the same
    tokens, and every counter the table keeps is the one it has without forgetting."""
    arrivals = [
        (step, f"r{i}", prompt(n, i), params(out, tenant=f"t{tenant}", ignore_eos=True))
        for i, (step, tenant, n, out) in enumerate(traffic)
    ]
    runs = []
    for forget in (True, False):
        sched = make_scheduler(
            capacity=400,
            fairness="vtc",
            fairness_preempt_bound=bound,
            chunked_prefill_size=32,
            max_running_requests=3,
            strict_invariants=True,
        )
        counters = sched.fairness
        assert counters is not None
        if not forget:
            counters.holders = None
        seen: list[tuple[object, ...]] = []

        def watch(s: Scheduler, step: int, seen: list[tuple[object, ...]] = seen) -> None:
            assert s.fairness is not None
            s.fairness.forget_at = 0  # the arrivals of the next step each sweep the table
            batch = s.last_batch
            plan = None
            if batch is not None:
                plan = (
                    batch.kind,
                    tuple((r.rid, r.extend_range) for r in batch.extend_reqs),
                    tuple(r.rid for r in batch.decode_reqs),
                )
            seen.append((plan, dict(s.fairness.counters), s.fairness.last_served))

        out = run(sched, FakeWorker(400), arrivals, on_step=watch, overlap=overlap)
        runs.append((seen, out.tokens, counters.forgotten_total))
    (kept, tokens, _), (full, full_tokens, _) = runs
    assert tokens == full_tokens
    assert [k[0] for k in kept] == [f[0] for f in full]
    for (_, table, last), (_, full_table, full_last) in zip(kept, full, strict=True):
        assert last == full_last
        assert all(full_table[t] == c for t, c in table.items())


def test_a_forgotten_tenant_comes_back_where_its_counter_would_have_put_it() -> None:
    """t0 is served first and goes idle while t1 and t2 are served well past it; new tenants joining
    sweep the table and t0 is forgotten; when it comes back it is lifted to the least backlogged
    counter, as its own counter would have been, and every plan is the same as without forgetting."""
    arrivals = [(0, "a", "t0", 10, 2)]
    arrivals += [(5 + i // 2, f"b{i}", f"t{1 + i % 2}", 10, 4) for i in range(20)]
    arrivals += [(12 + i, f"x{i}", f"new{i}", 3, 1) for i in range(4)]
    arrivals += [(16, "a2", "t0", 10, 2)]
    outcomes = []
    for forget in (True, False):
        sched = make_scheduler(fairness="vtc", chunked_prefill_size=None, max_running_requests=4)
        counters = sched.fairness
        assert counters is not None
        if not forget:
            counters.holders = None
        plans, _ = _drive(sched, arrivals, sweep_always=True)
        outcomes.append((plans, counters.counter("t0"), counters.forgotten_total))
    (plans, t0, forgotten), (full_plans, full_t0, _) = outcomes
    assert forgotten >= 1
    assert plans == full_plans
    assert t0 == full_t0
