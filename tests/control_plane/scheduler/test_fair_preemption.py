"""Preemption for token fairness (docs/scheduler.md#fairness-preemption), on plain values: a tenant
far behind takes the room a flooding tenant holds (running slots, or KV), the churn bound, and over
random traffic every request still gets exactly the tokens it gets without preemption."""

from __future__ import annotations

import random
from copy import deepcopy

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.record.recorder import RecordingScheduler, recording_header
from control_plane.record.replay import replay_scheduler
from control_plane.scheduler.fair_preemption import MIN_RUN_TOKENS
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import WorkerLimits
from tests.control_plane.factories import make_config, make_scheduler, params, prompt, run
from tests.control_plane.fake_worker import FakeWorker
from tests.record.conftest import ListSink


def _step(sched: Scheduler, worker: FakeWorker) -> list[str]:
    """One plan and its result; returns the ids of the requests whose first token it published."""
    plan = sched.next_plan()
    if plan is not None:
        sched.apply_result(worker.run(plan))
    return [r for r, req in sched.requests.items() if req.num_outputs == 1]


def _first_token_step(bound: float, good_out: int = 4, **config: object) -> tuple[int, Scheduler]:
    """Four flood requests fill the worker and run MIN_RUN_TOKENS steps; then `good` arrives: the
    steps until it has its first token. (VTC's lift starts good's counter at flood's, the last served:
    the gap is what flood is served, 8 weighted tokens a step, while good waits; flood gives way once
    the gap passes the bound and good's prompt, 40.)"""
    sched = make_scheduler(fairness="vtc", fairness_preempt_bound=bound, chunked_prefill_size=None, **config)
    worker = FakeWorker(sched.capacity)
    for i in range(4):
        sched.add_request(f"f{i}", prompt(40, i), params(300, tenant="flood", ignore_eos=True))
    for _ in range(MIN_RUN_TOKENS + 2):
        _step(sched, worker)
    sched.add_request("good", prompt(40, 9), params(good_out, tenant="good", ignore_eos=True))
    for step in range(1, 400):
        _step(sched, worker)
        if sched.requests["good"].num_outputs >= 1:
            return step, sched
    return 400, sched


def test_a_full_running_batch_gives_way_to_a_tenant_far_behind() -> None:
    without, _ = _first_token_step(0.0, max_running_requests=4)
    with_bound, sched = _first_token_step(10.0, max_running_requests=4)
    assert without > 250  # waits for a flood request to finish its 300 tokens
    assert with_bound <= 9  # (10 + 40) / 8 steps, and its own
    assert sched.fair_preemption is not None and sched.fair_preemption.preempted_total == 1
    # The flood request that gave way is back in the queue, to be re-prefilled.
    assert [r.params.tenant for r in sched.waiting] == ["flood"]


def test_a_full_kv_pool_gives_way_too() -> None:
    # The flood's tokens and reserved decodes leave no room for 40 + 600 more.
    without, _ = _first_token_step(0.0, 600, capacity=1400)
    with_bound, sched = _first_token_step(10.0, 600, capacity=1400)
    assert without > 100
    assert with_bound <= 9
    assert sched.fair_preemption is not None and sched.fair_preemption.preempted_total >= 1


def test_no_preemption_within_the_bound_or_before_the_minimum_run() -> None:
    # The tenants' counters are within the bound: nothing gives way.
    within, sched = _first_token_step(1e9, max_running_requests=4)
    assert within > 250
    assert sched.fair_preemption is not None and sched.fair_preemption.preempted_total == 0
    # The flood's requests have not run MIN_RUN_TOKENS yet: nothing gives way either.
    sched = make_scheduler(
        fairness="vtc", fairness_preempt_bound=1.0, chunked_prefill_size=None, max_running_requests=4
    )
    worker = FakeWorker(sched.capacity)
    for i in range(4):
        sched.add_request(f"f{i}", prompt(40, i), params(300, tenant="flood", ignore_eos=True))
    for _ in range(3):
        _step(sched, worker)
    sched.add_request("good", prompt(40, 9), params(4, tenant="good", ignore_eos=True))
    for _ in range(MIN_RUN_TOKENS - 5):
        _step(sched, worker)
    assert sched.requests["good"].num_outputs == 0
    assert sched.fair_preemption is not None and sched.fair_preemption.preempted_total == 0


def test_the_victim_is_the_most_served_tenants_least_progressed_and_gives_way_once_per_run() -> None:
    sched = make_scheduler(
        fairness="vtc", fairness_preempt_bound=10.0, chunked_prefill_size=None, max_running_requests=4
    )
    worker = FakeWorker(sched.capacity)
    sched.add_request("old", prompt(40, 0), params(300, tenant="flood", ignore_eos=True))
    for _ in range(5):
        _step(sched, worker)
    for i in range(3):
        sched.add_request(f"f{i}", prompt(40, i + 1), params(300, tenant="flood", ignore_eos=True))
    for _ in range(MIN_RUN_TOKENS + 2):
        _step(sched, worker)
    for i in range(3):
        sched.add_request(f"g{i}", prompt(40, 10 + i), params(2, tenant="good", ignore_eos=True))
    preempted_at: dict[str, int] = {}
    for step in range(60):
        before = {r.rid for r in sched.waiting}
        _step(sched, worker)
        for r in sched.waiting:
            if r.rid not in before and r.params.tenant == "flood":
                assert r.rid not in preempted_at or step - preempted_at[r.rid] >= MIN_RUN_TOKENS
                preempted_at[r.rid] = step
    # "old" ran longest: the younger ones gave way first.
    assert "old" not in preempted_at
    assert preempted_at


TRAFFIC = st.lists(
    st.tuples(
        st.integers(0, 60),  # arrival step
        st.sampled_from(["a", "b", "c"]),
        st.integers(5, 60),  # prompt
        st.integers(1, 80),  # output
    ),
    min_size=1,
    max_size=24,
)


@settings(max_examples=25, deadline=None)
@given(TRAFFIC, st.booleans())
def test_every_request_gets_the_tokens_it_gets_without_preemption(
    traffic: list[tuple[int, str, int, int]], overlap: bool
) -> None:
    """Preemption changes when tokens come, never which (the fake worker's tokens depend on the
    context only): each request gets the same tokens as with plain VTC, and the pool's books and
    invariants hold at every step."""
    arrivals = [
        (step, f"r{i}", prompt(n, i), params(out, tenant=tenant, ignore_eos=True))
        for i, (step, tenant, n, out) in enumerate(traffic)
    ]
    outcomes = []
    for bound in (0.0, 20.0):
        sched = make_scheduler(
            capacity=400,
            fairness="vtc",
            fairness_preempt_bound=bound,
            chunked_prefill_size=32,
            max_running_requests=3,
            strict_invariants=True,
        )
        outcomes.append(run(sched, FakeWorker(400), arrivals, overlap=overlap))
        assert sched.is_idle
    plain, preempting = outcomes
    assert preempting.tokens == plain.tokens
    assert all(len(preempting.tokens[f"r{i}"]) == t[3] for i, t in enumerate(traffic))


def test_fair_preemptions_replay_identically() -> None:
    """The header carries the bound: a replay makes the same preemptions."""
    config = make_config(
        fairness="vtc", fairness_preempt_bound=10.0, chunked_prefill_size=None, max_running_requests=4
    )
    limits = WorkerLimits("w0", kv_capacity_tokens=2000, page_size=1, max_context=2048, vocab_size=1000)
    sink = ListSink()
    sched = RecordingScheduler(config, limits, sink)
    flood = [(0, f"f{i}", prompt(40, i), params(60, tenant="flood", ignore_eos=True)) for i in range(4)]
    good = [
        (MIN_RUN_TOKENS + 2, f"g{i}", prompt(40, 10 + i), params(4, tenant="good", ignore_eos=True))
        for i in range(3)
    ]
    run(sched, FakeWorker(2000), [*flood, *good], max_steps=400)
    assert sched.is_idle
    assert sched.fair_preemption is not None and sched.fair_preemption.preempted_total > 0
    report = replay_scheduler([recording_header(config, limits, "test"), *sink.entries])
    assert report.identical, report.describe()


def test_a_request_that_did_not_fit_is_matched_again_after_the_release() -> None:
    """A request matched a prefix cached in the tree, did not fit, and took room from the other
    tenant; releasing the victims evicts for the requests still running (retract_decode_steps
    each), which took the matched prefix: the retry locked an evicted node (ValueError) until the
    request was matched again."""
    traffic = [(6, "b", 5, 3, 0), (11, "b", 8, 96, 1), (27, "a", 12, 98, 1), (29, "b", 5, 54, 0)]
    traffic += [(31, "a", 16, 30, 0), (32, "b", 11, 39, 1), (34, "a", 17, 88, 0)]
    arrivals = [
        (step, f"r{i}", prompt(40, 100 + group) + prompt(n, i), params(out, tenant=tenant, ignore_eos=True))
        for i, (step, tenant, n, out, group) in enumerate(traffic)
    ]
    sched = make_scheduler(
        capacity=300,
        fairness="vtc",
        fairness_preempt_bound=1.0,
        chunked_prefill_size=None,
        max_running_requests=16,
        retract_decode_steps=60,
        strict_invariants=True,
    )
    out = run(sched, FakeWorker(300), arrivals)
    assert sched.fair_preemption is not None and sched.fair_preemption.preempted_total == 2
    assert {rid: len(tokens) for rid, tokens in out.tokens.items()} == {
        f"r{i}": t[3] for i, t in enumerate(traffic)
    }


def _pool_full_of_flood(**config: object) -> tuple[Scheduler, FakeWorker]:
    """40 flood requests (200-token prompts) at a decode reservation of 10% fill a 3,000-token pool
    with what they hold: each running one holds 216+ tokens and reserves under 10."""
    sched = make_scheduler(
        fairness="vtc",
        fairness_preempt_bound=10.0,
        chunked_prefill_size=None,
        capacity=3000,
        max_running_requests=256,
        init_new_token_ratio=0.1,
        min_new_token_ratio_factor=1.0,
        **config,
    )
    worker = FakeWorker(sched.capacity)
    for i in range(40):
        sched.add_request(f"f{i}", prompt(200, i), params(100, tenant="flood", ignore_eos=True))
    for _ in range(MIN_RUN_TOKENS + 2):
        _step(sched, worker)
    assert sched.waiting and sched.kv.available_size() < 300
    return sched, worker


def test_a_newcomer_preempts_only_the_room_it_needs() -> None:
    """good needs 40 + 100 tokens and a page: releasing one flood request frees its 216+ held
    tokens, so one gives way. Reckoned from the victims' reserved decodes alone (priority
    preemption's arithmetic, under 10 tokens each) it took seven."""
    sched, worker = _pool_full_of_flood()
    sched.add_request("good", prompt(40, 999), params(100, tenant="good", ignore_eos=True))
    for _ in range(4):
        _step(sched, worker)
    assert sched.requests["good"].num_outputs >= 1
    assert sched.fair_preemption is not None and sched.fair_preemption.preempted_total == 1


def test_level_tenants_do_not_take_room_from_each_other_in_turn() -> None:
    """Six tenants, all backlogged and served alike (VTC keeps them level), on a full pool: an
    admission charges its tenant its prompt (100), more than B above the others, and without the
    prompt in the reckoning every admission then took room from the tenant admitted before it (233
    preemptions for 120 requests, a third more steps)."""
    rng = random.Random(1)
    arrivals = [
        (0, f"r{i}", prompt(100, i), params(rng.randint(20, 60), tenant=f"t{i % 6}", ignore_eos=True))
        for i in range(120)
    ]
    steps = []
    for bound in (0.0, 10.0):
        sched = make_scheduler(
            capacity=3000,
            fairness="vtc",
            fairness_preempt_bound=bound,
            chunked_prefill_size=None,
            max_running_requests=256,
            init_new_token_ratio=0.1,
            min_new_token_ratio_factor=1.0,
        )
        out = run(sched, FakeWorker(3000), arrivals)
        assert sched.is_idle and all(len(out.tokens[rid]) == p.max_new_tokens for _, rid, _, p in arrivals)
        steps.append(out.steps)
    assert sched.fair_preemption is not None and sched.fair_preemption.preempted_total <= 24
    assert steps[1] <= steps[0] * 1.05


def test_what_a_release_frees_is_what_was_reckoned() -> None:
    """KvManager.release_gain, at every step of traffic sharing prefixes (locked by several requests,
    or by one), is what releasing that request adds to available + evictable."""
    traffic = [(i // 3, "ab"[i % 2], 5 + i % 7, 20 + i % 9, i % 3) for i in range(18)]
    arrivals = [
        (step, f"r{i}", prompt(24, 100 + group) + prompt(n, i), params(out, tenant=tenant, ignore_eos=True))
        for i, (step, tenant, n, out, group) in enumerate(traffic)
    ]
    checked = 0

    def check(sched: Scheduler, step: int) -> None:
        nonlocal checked
        for i, req in enumerate(sched.running.reqs):
            if req.finished:
                continue
            copy = deepcopy(sched)
            victim = copy.running.reqs[i]
            kv = copy.kv
            gain = kv.release_gain(victim)
            before = kv.available_size() + kv.evictable_size()
            copy.retraction.release_for_requeue(victim, remaining=0)
            assert kv.available_size() + kv.evictable_size() - before == gain, (step, victim.rid)
            checked += 1

    sched = make_scheduler(capacity=600, page_size=4, chunked_prefill_size=None, max_running_requests=8)
    run(sched, FakeWorker(600), arrivals, on_step=check)
    assert checked > 50
