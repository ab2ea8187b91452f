"""Overlap scheduling (docs/scheduler.md#overlap, #invariants): plans made while earlier results are still in
flight.

The fake worker's tokens depend only on each sequence's content, so the same trace must stream the
same tokens per request whether results are applied before the next plan (non-overlap) or one plan
later (overlap): what overlap changes is when things happen, never what is generated.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest

from control_plane.cache.invariants import check_pool_invariants
from control_plane.request import AbortCode, FinishKind, FinishReason, RequestParams
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import StepKind, StepResult
from tests.control_plane.factories import (
    EOS,
    FakeWorker,
    Outcome,
    add,
    by_rid,
    make_scheduler,
    params,
    prompt,
    run,
    run_plan,
)

Arrival = tuple[int, str, list[int], RequestParams]
CANCELLED = FinishReason.abort("cancelled by the client", AbortCode.CANCELLED)
STOP_STRING = FinishReason.stop("stop string matched")


def assert_whole(sched: Scheduler) -> None:
    """Idle with nothing leaked: every slot free or evictable, no lock, no row, no sequence."""
    kv = sched.kv
    assert sched.is_idle and sched.in_flight == 0 and sched.books() == (0, 0)
    assert kv.available_size() + kv.evictable_size() == sched.capacity
    assert kv.protected_size() == 0 and kv.free_rows() == sched.max_running_requests
    assert sched.host_used == 0 and not sched.offloaded


def both_modes(
    trace: list[Arrival],
    capacity: int = 4096,
    eos_every: int = 0,
    react: Callable[[Scheduler, Outcome], None] | None = None,
    **config: object,
) -> tuple[Outcome, Outcome]:
    """The same trace without and with overlap; each run checks books and invariants every step."""
    outcomes = []
    for overlap in (False, True):
        sched = make_scheduler(capacity=capacity, **config)
        worker = FakeWorker(capacity, eos=EOS, eos_every=eos_every)
        outcomes.append(run(sched, worker, trace, overlap=overlap, react=react))
        assert_whole(sched)
    return outcomes[0], outcomes[1]


def staggered(n: int, max_new: int, spread: int = 3, seed: int = 0, **kw: object) -> list[Arrival]:
    rng = random.Random(seed)
    return [
        (rng.randint(0, spread * n), f"r{i}", prompt(rng.randint(3, 40), seed + i), params(max_new, **kw))
        for i in range(n)
    ]


# (name, trace, scheduler config and pool) for the overlap-vs-non-overlap comparison.
SCENARIOS: dict[str, tuple[list[Arrival], dict[str, object]]] = {
    "plain decode": (staggered(8, 24), {"eos_every": 9}),
    "chunked prefill": (
        [(0, "long", prompt(150, 1), params(12)), *staggered(5, 16, seed=3)],
        {"chunked_prefill_size": 32},
    ),
    "mixed chunk": (
        [*staggered(4, 30, spread=1), (4, "long", prompt(120, 9), params(10))],
        {"chunked_prefill_size": 32, "enable_mixed_chunk": True},
    ),
    "kv-full retraction": (
        [(10 * i, f"r{i}", prompt(20 + i, i), params(150)) for i in range(6)],
        {"capacity": 400, "chunked_prefill_size": 64, "init_new_token_ratio": 0.2},
    ),
    "test_retract": (staggered(6, 30, spread=1), {"test_retract": True}),
    "sample groups": (
        [(0, f"g/{i}", prompt(12, 5), params(40, ignore_eos=True, group="g")) for i in range(3)]
        + staggered(4, 40, spread=1, seed=7),
        {"capacity": 256, "init_new_token_ratio": 0.05, "chunked_prefill_size": 32},
    ),
    "host backup pool": (
        staggered(12, 40, spread=1, seed=11, ignore_eos=True),
        {"capacity": 256, "host_pool": 100_000, "chunked_prefill_size": 32, "init_new_token_ratio": 0.02},
    ),
}


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_overlap_streams_the_same_tokens(scenario: str, page_size: int) -> None:
    trace, config = SCENARIOS[scenario]
    plain, overlap = both_modes(trace, page_size=page_size, **config)  # type: ignore[arg-type]
    assert overlap.tokens == plain.tokens
    assert overlap.finished == plain.finished
    assert len(overlap.plans) >= len(plain.plans)


def _scenario_reached(scenario: str, page_size: int) -> bool:
    """Whether the scenario exercises what it is named after (so the comparison is not vacuous)."""
    trace, config = SCENARIOS[scenario]
    config = dict(config)
    eos_every = int(config.pop("eos_every", 0))  # type: ignore[call-overload]
    capacity = int(config.pop("capacity", 4096))  # type: ignore[call-overload]
    sched = make_scheduler(capacity=capacity, page_size=page_size, **config)
    out = run(sched, FakeWorker(capacity, eos=EOS, eos_every=eos_every), trace, overlap=True)
    if scenario in ("kv-full retraction", "test_retract", "sample groups", "host backup pool"):
        return sched.num_retracted_total > 0 or any(f.kind is FinishKind.ABORT for f in out.finished.values())
    if scenario == "chunked prefill":
        return any(not p.extends.sample.all() for p in out.plans)
    if scenario == "mixed chunk":
        return any(p.kind is StepKind.MIXED for p in out.plans)
    return any(f.message == "eos" for f in out.finished.values())


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_each_scenario_reaches_its_case(scenario: str) -> None:
    assert all(_scenario_reached(scenario, page) for page in (1, 4, 16)), scenario


def _end_after(counts: dict[str, int], how: str) -> Callable[[Scheduler, Outcome], None]:
    """As the engine reacts to what it streamed: end request rid once it has counts[rid] tokens."""

    def react(sched: Scheduler, out: Outcome) -> None:
        for rid, n in counts.items():
            if len(out.tokens.get(rid, [])) >= n and rid not in out.finished and rid in sched.requests:
                if how == "finish":
                    assert sched.finish(rid, STOP_STRING)
                else:
                    assert sched.abort(rid, CANCELLED)

    return react


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("how", ["finish", "abort"])
def test_ending_a_request_while_its_next_step_is_in_flight(how: str, page_size: int) -> None:
    """A stop string (`finish`, KV cached) or an abort (KV freed) seen in the tokens of result N: under
    overlap plan N+1 already decodes the request, and that token is discarded; the request streams
    exactly the tokens it streamed without overlap, and its slots (the one of the decode in flight
    too) all come back."""
    trace = staggered(6, 40, spread=1, seed=21)
    counts = {"r0": 1, "r2": 5, "r4": 12}
    plain, overlap = both_modes(trace, page_size=page_size, react=_end_after(counts, how))
    assert overlap.tokens == plain.tokens
    assert overlap.finished == plain.finished
    for rid, n in counts.items():
        assert len(overlap.tokens[rid]) == n
        assert overlap.finished[rid] == (STOP_STRING if how == "finish" else CANCELLED)


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_new_tokens_n_is_n_decodes_under_overlap_and_n_minus_1_without(n: int) -> None:
    """docs/scheduler.md#overlap (a): a request that finishes when result N is applied is still in plan
    N+1 (a dead
    decode, its token discarded): N decode forwards under overlap, N − 1 without; N tokens in both."""
    for overlap, decodes in ((True, n), (False, n - 1)):
        sched = make_scheduler()
        out = run(sched, FakeWorker(4096), [(0, "r", prompt(8), params(n, ignore_eos=True))], overlap=overlap)
        assert out.decodes()["r"] == decodes
        assert len(out.tokens["r"]) == n and out.finished["r"].kind is FinishKind.LENGTH
        assert_whole(sched)


def test_a_prefill_in_flight_is_merged_and_decoded_before_its_first_token_is_known() -> None:
    sched = make_scheduler()
    worker = FakeWorker(4096)
    req = add(sched, "a", prompt(8), params(5, ignore_eos=True))
    prefill = sched.next_plan()
    assert prefill is not None and prefill.kind is StepKind.PREFILL
    first = run_plan(sched, worker, prefill)
    decode = sched.next_plan()
    assert decode is not None and decode.decodes.handles.tolist() == [req.handle]
    assert req.output_ids == [] and sched.in_flight == 2 and not sched.is_idle
    second = run_plan(sched, worker, decode)
    sched.apply_result(first)
    assert len(req.output_ids) == 1 and sched.in_flight == 1
    sched.apply_result(second)
    assert len(req.output_ids) == 2 and sched.in_flight == 0
    assert by_rid(sched.take_updates())["a"] == req.output_ids


def test_a_result_is_for_the_oldest_plan_in_flight() -> None:
    sched = make_scheduler()
    worker = FakeWorker(4096)
    add(sched, "a", prompt(8), params(5, ignore_eos=True))
    with pytest.raises(ValueError, match="no plan is in flight"):
        sched.apply_result(StepResult(step_id=1))
    first = sched.next_plan()
    assert first is not None
    result = worker.run(first)
    second = sched.next_plan()
    assert second is not None
    with pytest.raises(ValueError, match=f"oldest plan in flight is {first.step_id}"):
        sched.apply_result(worker.run(second))
    with pytest.raises(ValueError, match="carries 0 tokens, the plan sampled 1"):
        sched.apply_result(StepResult(step_id=first.step_id))
    assert sched.in_flight == 2  # refused results change nothing
    sched.apply_result(result)
    assert sched.in_flight == 1


def test_remaps_found_while_applying_result_n_go_into_the_next_plan_built() -> None:
    """Two identical prompts prefilled together: applying that result caches the first one's prompt
    and the second's duplicate slots are freed and remapped. Plan N+1 was built already; the remap goes
    into N+2, before which the worker still reads the old (intact) slots."""
    sched = make_scheduler(capacity=512)
    worker = FakeWorker(512)
    for rid in ("a", "b"):
        add(sched, rid, prompt(40, 3), params(6, ignore_eos=True))
    prefill = sched.next_plan()
    assert prefill is not None and len(prefill.extends) == 2
    first = run_plan(sched, worker, prefill)
    decode = sched.next_plan()
    assert decode is not None and not decode.remaps
    second = run_plan(sched, worker, decode)
    sched.apply_result(first)
    after = sched.next_plan()
    assert after is not None and [r.handle for r in after.remaps] == [sched.requests["b"].handle]
    run_plan(sched, worker, after)
    sched.apply_result(second)
    check_pool_invariants(sched.kv.allocator, sched.kv.tree, sched.private_slots())


def test_a_request_aborted_between_plan_and_result_gives_back_its_decode_slot() -> None:
    """The decode slot a plan allocated for a request that ends before the plan's result is applied is
    not committed KV: docs/scheduler.md#caching-requests caches or frees the committed part, and the rest
    goes back to the allocator
    (SGLang's kv_allocated_len beyond kv_committed_len). Otherwise the slot leaks."""
    for page_size in (1, 4):
        sched = make_scheduler(capacity=256, page_size=page_size, chunked_prefill_size=None)
        worker = FakeWorker(256)
        sched.add_request("a", prompt(8, 1), params(20, ignore_eos=True))
        sched.add_request("b", prompt(9, 2), params(20, ignore_eos=True))
        for _ in range(2):  # the prefill, then a decode
            plan = sched.next_plan()
            assert plan is not None
            sched.apply_result(worker.run(plan))
        plan = sched.next_plan()
        assert plan is not None and len(plan.decodes) == 2
        assert sched.abort("a", FinishReason.abort("cancelled", AbortCode.CANCELLED))
        sched.apply_result(worker.run(plan))
        check_pool_invariants(sched.kv.allocator, sched.kv.tree, sched.private_slots())


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_row_reused_while_an_old_result_is_in_flight_gets_none_of_its_tokens(page_size: int) -> None:
    """With three plans in flight a request's row can pass to another request while a plan that named
    the old owner is still to be applied: its token is told apart by the row's tenancy, not by the row.
    Tokens equal the non-overlap run's; at least one such reuse happens."""
    trace = staggered(10, 12, spread=1, seed=5)
    base = run(make_scheduler(), FakeWorker(4096, eos=EOS, eos_every=5), trace)
    sched = make_scheduler(page_size=page_size, max_running_requests=2)
    apply_result = sched.apply_result
    reused = 0

    def apply_counting_reuse(result: StepResult) -> None:
        nonlocal reused
        batch = sched._in_flight[0]
        serials = sched.kv.columns.serial[batch.decode_rows]
        reused += int(np.count_nonzero((serials != batch.decode_serials) & (serials != 0)))
        apply_result(result)

    sched.apply_result = apply_counting_reuse  # type: ignore[method-assign]
    out = run(sched, FakeWorker(4096, eos=EOS, eos_every=5), trace, overlap=True, depth=3)
    assert out.tokens == base.tokens and out.finished == base.finished
    assert reused > 0
    assert_whole(sched)
