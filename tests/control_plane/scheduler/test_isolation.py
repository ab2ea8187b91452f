"""Step isolation between tenants (docs/scheduler.md#fairness-isolation), on plain values: while a
tenant below its share of the running batch has requests live, the tenants above theirs get at most
T prompt tokens a step, go behind its requests and stay out of the step that admits one (their
chunk in progress included), give way to it for a slot, and hold at most R running requests; with
one tenant nothing changes; over random traffic every request gets exactly the tokens it gets
without the rule, with the pool's books and invariants holding at every step."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from control_plane.config import SchedulerConfig, validate_scheduler_config
from control_plane.record.recorder import RecordingScheduler, recording_header
from control_plane.record.replay import replay_scheduler
from control_plane.scheduler.fair_preemption import MIN_RUN_TOKENS
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import StepKind, StepPlan, WorkerLimits
from stepwise import simulate
from tests.control_plane.factories import make_config, make_scheduler, params, prompt, run
from tests.control_plane.fake_worker import FakeWorker
from tests.record.conftest import ListSink


def _tokens_by_tenant(sched: Scheduler) -> dict[str, int]:
    """Prompt tokens of the latest plan's extends, by tenant."""
    batch = sched.last_batch
    out: dict[str, int] = {}
    if batch is None or not batch.is_extend:
        return out
    for req in batch.extend_reqs:
        start, end = req.extend_range
        out[req.params.tenant] = out.get(req.params.tenant, 0) + end - start
    return out


def _step(sched: Scheduler, worker: FakeWorker) -> StepPlan | None:
    plan = sched.next_plan()
    if plan is not None:
        sched.apply_result(worker.run(plan))
    sched.take_updates()
    return plan


def _flood_beside_good(tokens: int, running: int = 0, **config: object) -> tuple[Scheduler, FakeWorker]:
    """Three flood requests and one good request running (flood holds 3 of 4: above its half);
    each runs for a long time."""
    sched = make_scheduler(
        fairness="vtc",
        fairness_isolation_tokens=tokens,
        fairness_isolation_running=running,
        chunked_prefill_size=256,
        **config,
    )
    worker = FakeWorker(sched.capacity)
    for i in range(3):
        sched.add_request(f"f{i}", prompt(40, i), params(500, tenant="flood", ignore_eos=True))
    _step(sched, worker)
    sched.add_request("g0", prompt(40, 50), params(500, tenant="good", ignore_eos=True))
    _step(sched, worker)
    _step(sched, worker)
    assert {r.rid for r in sched.running.reqs} == {"f0", "f1", "f2", "g0"}
    return sched, worker


def test_a_heavy_tenant_gets_at_most_t_prompt_tokens_a_step() -> None:
    sched, worker = _flood_beside_good(64)
    for i in range(6):
        sched.add_request(f"f{3 + i}", prompt(40, 3 + i), params(8, tenant="flood", ignore_eos=True))
    _step(sched, worker)
    # 40 + a 24-token chunk of the next: T = 64, where SGLang's step would take all 240.
    assert _tokens_by_tenant(sched) == {"flood": 64}
    assert sched.chunked_req is not None and sched.chunked_req.rid == "f4"
    assert sched.isolation is not None and sched.isolation.passes_held > 0


def test_without_the_rule_the_flood_fills_the_chunk() -> None:
    sched, worker = _flood_beside_good(0)
    for i in range(6):
        sched.add_request(f"f{3 + i}", prompt(40, 3 + i), params(8, tenant="flood", ignore_eos=True))
    _step(sched, worker)
    assert _tokens_by_tenant(sched) == {"flood": 240}


def test_a_light_tenants_request_goes_first_and_alone() -> None:
    sched, worker = _flood_beside_good(64)
    for i in range(6):
        sched.add_request(f"f{3 + i}", prompt(40, 3 + i), params(8, tenant="flood", ignore_eos=True))
    sched.add_request("g1", prompt(40, 60), params(8, tenant="good", ignore_eos=True))
    _step(sched, worker)
    assert _tokens_by_tenant(sched) == {"good": 40}
    _step(sched, worker)
    assert _tokens_by_tenant(sched) == {"flood": 64}


def test_the_heavy_chunk_in_progress_sits_out_the_light_step() -> None:
    sched, worker = _flood_beside_good(64)
    sched.add_request("big", prompt(200, 7), params(8, tenant="flood", ignore_eos=True))
    _step(sched, worker)
    assert _tokens_by_tenant(sched) == {"flood": 64}
    assert sched.chunked_req is not None and sched.chunked_req.rid == "big"
    sched.add_request("g1", prompt(40, 60), params(8, tenant="good", ignore_eos=True))
    _step(sched, worker)
    assert _tokens_by_tenant(sched) == {"good": 40}
    _step(sched, worker)
    assert _tokens_by_tenant(sched) == {"flood": 64}
    big = sched.requests["big"]
    assert big.extend_range == (64, 128)


def test_a_heavy_tenant_gives_way_for_a_slot_without_a_preempt_bound() -> None:
    def first_token_step(tokens: int) -> tuple[int, Scheduler]:
        sched = make_scheduler(
            fairness="vtc", fairness_isolation_tokens=tokens, chunked_prefill_size=256, max_running_requests=4
        )
        worker = FakeWorker(sched.capacity)
        for i in range(4):
            sched.add_request(f"f{i}", prompt(40, i), params(300, tenant="flood", ignore_eos=True))
        for _ in range(MIN_RUN_TOKENS + 2):
            _step(sched, worker)
        sched.add_request("good", prompt(40, 9), params(4, tenant="good", ignore_eos=True))
        for step in range(1, 400):
            _step(sched, worker)
            if sched.requests["good"].num_outputs >= 1:
                return step, sched
        return 400, sched

    without, _ = first_token_step(0)
    with_rule, sched = first_token_step(64)
    assert without > 250  # VTC's lift puts good level with flood: it waits for a flood request to end
    assert with_rule <= 2
    assert sched.fair_preemption is not None and sched.fair_preemption.preempted_total == 1
    assert [r.params.tenant for r in sched.waiting] == ["flood"]


def test_heavy_tenants_hold_at_most_r_running_requests_while_a_light_one_is_live() -> None:
    sched, worker = _flood_beside_good(64, running=3, max_running_requests=16)
    for i in range(4):
        sched.add_request(f"f{3 + i}", prompt(40, 3 + i), params(8, tenant="flood", ignore_eos=True))
    for _ in range(5):
        _step(sched, worker)
        assert sum(r.params.tenant == "flood" for r in sched.running.reqs) == 3
    assert len(sched.waiting) == 4
    sched.abort("g0", _abort())
    for _ in range(3):
        _step(sched, worker)
    # No light tenant is live any more: the flood is admitted as SGLang would.
    assert not sched.waiting


def test_shares_are_counted_in_the_tokens_running_requests_hold() -> None:
    """Flood holds 2 running requests of 200+ tokens, good 3 of 20: good holds more requests but a
    tenth of the tokens. The flood is the heavy one (its decode rows cost their context, its KV
    fills the pool): good's next request goes first and alone, the flood's after it."""
    sched = make_scheduler(fairness="vtc", fairness_isolation_tokens=64, chunked_prefill_size=512)
    worker = FakeWorker(sched.capacity)
    for i in range(2):
        sched.add_request(f"f{i}", prompt(200, i), params(500, tenant="flood", ignore_eos=True))
    _step(sched, worker)
    for i in range(3):
        sched.add_request(f"g{i}", prompt(20, 10 + i), params(500, tenant="good", ignore_eos=True))
    _step(sched, worker)
    _step(sched, worker)
    assert {r.rid for r in sched.running.reqs} == {"f0", "f1", "g0", "g1", "g2"}
    sched.add_request("f2", prompt(40, 20), params(8, tenant="flood", ignore_eos=True))
    sched.add_request("g3", prompt(20, 21), params(8, tenant="good", ignore_eos=True))
    _step(sched, worker)
    assert _tokens_by_tenant(sched) == {"good": 20}
    _step(sched, worker)
    assert _tokens_by_tenant(sched) == {"flood": 40}


@pytest.mark.parametrize("turn", [False, True])
def test_a_decode_step_follows_each_heavy_only_prefill_while_a_light_request_runs(turn: bool) -> None:
    """With prefill first a backlogged flood makes every step a prefill (held to T), so good's
    running request never decodes; with the decode turn every other step is a decode."""
    sched, worker = _flood_beside_good(64, fairness_isolation_decode_turn=turn)
    for i in range(6):
        sched.add_request(f"f{3 + i}", prompt(40, 3 + i), params(8, tenant="flood", ignore_eos=True))
    before = sched.requests["g0"].num_outputs
    kinds = []
    for _ in range(4):
        plan = _step(sched, worker)
        assert plan is not None
        kinds.append(plan.kind)
    prefill, decode = StepKind.PREFILL, StepKind.DECODE
    assert kinds == ([prefill, decode, prefill, decode] if turn else [prefill] * 4)
    assert sched.requests["g0"].num_outputs - before == (2 if turn else 0)


def _timed_step(sched: Scheduler, worker: FakeWorker, seconds: float) -> StepPlan | None:
    """A step whose result says the worker spent `seconds` on it (the queue clock's time)."""
    plan = sched.next_plan()
    if plan is not None:
        sched.apply_result(dataclasses.replace(worker.run(plan), forward_s=seconds))
    sched.take_updates()
    return plan


@pytest.mark.parametrize("grace", [0.0, 1.0])
def test_a_tenant_stays_known_for_the_grace_after_its_last_request(grace: float) -> None:
    """Good's only request ends; the flood's next prompts get T a step while the worker has spent
    less than the grace since good was last live, then SGLang's chunk again."""
    sched, worker = _flood_beside_good(64, fairness_isolation_grace=grace)
    sched.abort("g0", _abort())
    while any(r.params.tenant == "good" for r in sched.running.reqs):
        _timed_step(sched, worker, 0.1)
    for i in range(6):
        sched.add_request(f"f{3 + i}", prompt(40, 3 + i), params(8, tenant="flood", ignore_eos=True))
    _timed_step(sched, worker, 0.1)
    assert _tokens_by_tenant(sched) == {"flood": 64 if grace else 240}
    for _ in range(12):
        _timed_step(sched, worker, 0.1)
    for i in range(6):
        sched.add_request(f"f{9 + i}", prompt(40, 9 + i), params(8, tenant="flood", ignore_eos=True))
    _timed_step(sched, worker, 0.1)
    # More than a second of steps since good was last live: it is forgotten.
    assert _tokens_by_tenant(sched) == {"flood": 240}


def _abort():  # type: ignore[no-untyped-def]
    from control_plane.request import FinishReason

    return FinishReason.abort("test")


def test_one_tenant_alone_is_scheduled_as_without_the_rule() -> None:
    arrivals = [
        (i % 7, f"r{i}", prompt(20 + 13 * i % 90, i), params(5 + i % 30, tenant="solo", ignore_eos=True))
        for i in range(20)
    ]
    plans = []
    for tokens in (0, 16):
        sched = make_scheduler(
            capacity=600, fairness="vtc", fairness_isolation_tokens=tokens, chunked_prefill_size=64
        )
        out = run(sched, FakeWorker(600), arrivals, overlap=True)
        plans.append([(p.kind, p.extends.lens.tolist(), p.decodes.handles.tolist()) for p in out.plans])
    assert plans[0] == plans[1]


TRAFFIC = st.lists(
    st.tuples(
        st.integers(0, 60),  # arrival step
        st.sampled_from(["a", "b", "c"]),
        st.integers(5, 60),  # prompt
        st.integers(1, 80),  # output
        st.integers(-1, 2),  # shared prefix group (-1: none)
    ),
    min_size=1,
    max_size=24,
)


def _prompt(i: int, n: int, group: int) -> list[int]:
    """Request i's prompt: n tokens of its own, after group's 24 shared ones when group >= 0 (so
    admissions match cached prefixes, which a preemption's eviction may take)."""
    return (prompt(24, 100 + group) if group >= 0 else []) + prompt(n, i)


@settings(max_examples=25, deadline=None)
@given(TRAFFIC, st.booleans(), st.sampled_from([0, 2]), st.booleans())
# Tenant b fills two of the three slots, then a arrives: b is heavy, a's requests go first.
@example(
    [(0, "b", 5, 34, -1), (1, "b", 5, 35, -1), (19, "a", 5, 32, -1), (19, "a", 28, 17, -1)], False, 0, False
)
@example(
    [(0, "b", 40, 60, 0), (0, "b", 40, 60, 1), (2, "b", 60, 30, 0), (5, "a", 20, 10, 1), (6, "a", 30, 5, 0)],
    True,
    2,
    True,
)
def test_every_request_gets_the_tokens_it_gets_without_the_rule(
    traffic: list[tuple[int, str, int, int, int]], overlap: bool, running_cap: int, turn: bool
) -> None:
    """Isolation changes when tokens come, never which (the fake worker's tokens depend on the
    context only); the pool's books and invariants hold at every step, and every plan made under a
    budget keeps it: heavy prompt tokens at most T, none beside a light request."""
    arrivals = [
        (step, f"r{i}", _prompt(i, n, group), params(out, tenant=tenant, ignore_eos=True))
        for i, (step, tenant, n, out, group) in enumerate(traffic)
    ]
    outcomes = []
    for tokens in (0, 8):
        sched = make_scheduler(
            capacity=400,
            fairness="vtc",
            fairness_isolation_tokens=tokens,
            fairness_isolation_running=running_cap if tokens else 0,
            fairness_isolation_decode_turn=turn and tokens > 0,
            chunked_prefill_size=32,
            max_running_requests=3,
            strict_invariants=True,
        )

        def keeps_budget(sched: Scheduler, step: int) -> None:
            budget = sched.isolation.last if sched.isolation is not None else None
            batch = sched.last_batch
            if budget is None or batch is None or batch.kind is StepKind.DECODE:
                return
            heavy = [i for i, r in enumerate(batch.extend_reqs) if r.params.tenant in budget.heavy]
            held = sum(
                batch.extend_reqs[i].extend_range[1] - batch.extend_reqs[i].extend_range[0] for i in heavy
            )
            assert held <= 8
            if len(heavy) < len(batch.extend_reqs):
                # Beside a light request only the chunk in progress (always first) may be heavy.
                assert heavy in ([], [0])

        outcomes.append(run(sched, FakeWorker(400), arrivals, overlap=overlap, on_step=keeps_budget))
        assert sched.is_idle
    plain, isolated = outcomes
    assert isolated.tokens == plain.tokens
    assert all(len(isolated.tokens[f"r{i}"]) == t[3] for i, t in enumerate(traffic))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"fairness_isolation_tokens": 64}, "--fairness-isolation-tokens requires --fairness"),
        (
            {"fairness": "vtc", "fairness_isolation_tokens": 64, "chunked_prefill_size": None},
            "--fairness-isolation-tokens requires chunked prefill",
        ),
        ({"fairness": "vtc", "fairness_isolation_running": 8}, "--fairness-isolation-running requires"),
        ({"fairness": "vtc", "fairness_isolation_grace": 2.0}, "--fairness-isolation-grace requires"),
        (
            {"fairness": "vtc", "fairness_isolation_decode_turn": True},
            "--fairness-isolation-decode-turn requires",
        ),
    ],
)
def test_the_flags_need_fairness_and_chunking(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_scheduler_config(dataclasses.replace(SchedulerConfig(), **changes))  # type: ignore[arg-type]


def test_simulate_takes_the_flags() -> None:
    ns = simulate.build_parser().parse_args(
        [
            *("--fairness", "vtc", "--fairness-isolation-tokens", "512"),
            *("--fairness-isolation-running", "128", "--fairness-isolation-grace", "5"),
            "--fairness-isolation-decode-turn",
        ]
    )
    config = simulate.setup_from_args(ns).config
    isolation = (config.fairness_isolation_tokens, config.fairness_isolation_running)
    assert (*isolation, config.fairness_isolation_grace) == (512, 128, 5.0)
    assert config.fairness_isolation_decode_turn


def test_isolated_plans_replay_identically() -> None:
    """The header carries T, R and the grace: a replay makes the same budgets, orders and
    preemptions (the grace reads the queue clock, which replays from the results)."""
    config = make_config(
        fairness="vtc",
        fairness_isolation_tokens=16,
        fairness_isolation_running=3,
        fairness_isolation_grace=0.5,
        fairness_isolation_decode_turn=True,
        chunked_prefill_size=64,
        max_running_requests=5,
    )
    limits = WorkerLimits("w0", kv_capacity_tokens=2000, page_size=1, max_context=2048, vocab_size=1000)
    sink = ListSink()
    sched = RecordingScheduler(config, limits, sink)
    flood = [(0, f"f{i}", prompt(40, i), params(60, tenant="flood", ignore_eos=True)) for i in range(6)]
    good = [
        (step, f"g{step}-{i}", prompt(30, step + i), params(4, tenant="good", ignore_eos=True))
        for step in (MIN_RUN_TOKENS + 2, MIN_RUN_TOKENS + 30)
        for i in range(2)
    ]
    run(sched, FakeWorker(2000), [*flood, *good], max_steps=600)
    assert sched.is_idle
    assert sched.isolation is not None and sched.isolation.passes_held > 0
    report = replay_scheduler([recording_header(config, limits, "test"), *sink.entries])
    assert report.identical, report.describe()
