"""Cache-aware order past 128 waiting requests, the 2026 policies and the starvation bound
(docs/scheduler.md#kept-matches, #hrrn, #spf, #lpm-aging, #max-queue-wait)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.request import Request
from control_plane.scheduler.policy import LPM_FALLBACK_QUEUE_LEN, PrefixMatcher
from control_plane.scheduler.scheduler import Scheduler
from tests.control_plane.factories import make_config, make_scheduler, prompt
from tests.control_plane.fake_worker import FakeWorker
from tests.control_plane.scheduler.test_policy import cache, ordered, req

DEEP = LPM_FALLBACK_QUEUE_LEN + 1


def cold(n: int, first_seed: int = 100) -> list[Request]:
    return [req(f"q{i}", prompt(10, first_seed + i), t=i) for i in range(n)]


def test_lpm_without_cutoff_orders_past_128_waiting() -> None:
    sched = make_scheduler(schedule_policy="lpm", cache_aware_queue_limit=0)
    cached = prompt(100, seed=7)
    cache(sched, cached)
    queue = [
        *cold(DEEP + 300),
        req("hit", cached[:90] + prompt(5, 1)),
        req("hit2", cached[:40] + prompt(5, 2)),
    ]
    assert ordered(sched, queue)[:2] == ["hit", "hit2"]
    assert queue[0].num_matched_prefix_tokens == 90


def test_the_cutoff_is_a_flag() -> None:
    sched = make_scheduler(schedule_policy="lpm", cache_aware_queue_limit=300)
    cached = prompt(100, seed=7)
    cache(sched, cached)
    hit = req("hit", cached[:90] + prompt(5, 1))
    assert ordered(sched, [*cold(300), hit])[-1] == "hit"  # 301 waiting: FCFS
    assert ordered(sched, [*cold(299), hit])[0] == "hit"  # 300 waiting: LPM


def test_a_deep_pass_leaves_the_tree_alone() -> None:
    """Past 128 the kept matches are read: no split, no access time (SGLang's full pass stamps
    both; docs/scheduler.md#kept-matches says where this departs)."""
    sched = make_scheduler(schedule_policy="lpm", cache_aware_queue_limit=0)
    cached = prompt(100, seed=7)
    cache(sched, cached)
    tree = sched.kv.tree
    before = [(len(n.key), n.last_access_time) for n in tree.iter_nodes()]
    ordered(sched, [*cold(DEEP), req("mid", cached[:50] + prompt(5, 1))])
    assert [(len(n.key), n.last_access_time) for n in tree.iter_nodes()] == before
    ordered(sched, [req("mid", cached[:50] + prompt(5, 1))])  # a shallow pass is SGLang's
    assert len(list(tree.iter_nodes())) == len(before) + 1


def test_the_default_keeps_no_matches() -> None:
    sched = make_scheduler(schedule_policy="lpm")
    assert sched.kv.tree.listener is None
    assert sched.policy.matcher.kept is None  # type: ignore[attr-defined]


group_st = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 40), st.integers(1, 60)), min_size=1, max_size=40
)


@given(shape=group_st, check=st.integers(-1, 40), deprioritize=st.integers(0, 40))
@settings(max_examples=120, deadline=None)
def test_kept_dedup_equals_the_simulated_tree(
    shape: list[tuple[int, int, int]], check: int, deprioritize: int
) -> None:
    """The dedup through first tokens deprioritizes exactly what SGLang's simulated tree does."""
    config = make_config(
        schedule_policy="lpm",
        cache_aware_queue_limit=0,
        in_batch_prefix_check_threshold=check,
        in_batch_prefix_deprioritize_threshold=deprioritize,
    )
    sched = Scheduler(config, make_scheduler().limits)
    cached = prompt(60, seed=3)
    cache(sched, cached)
    bases = [cached, prompt(60, 4), prompt(60, 5), prompt(60, 6), prompt(60, 7)]
    queue = [
        req(f"r{i}", bases[g][:shared] + prompt(own, 50 + i), t=i) for i, (g, shared, own) in enumerate(shape)
    ]
    full = PrefixMatcher(sched.kv, config)
    kept = PrefixMatcher(sched.kv, config, kept=False)
    kept.kept = sched.policy.matcher.kept  # type: ignore[attr-defined]
    assert kept.match_kept(queue) == full.match_all(queue)


# --- hrrn (SGLang's _sort_by_hrrn) -------------------------------------------------------------------


def test_hrrn_orders_by_tokens_waited_per_uncached_token() -> None:
    sched = make_scheduler(schedule_policy="hrrn")
    cached = prompt(100, seed=7)
    cache(sched, cached)
    sched.queue_clock.prefill_tokens = 1000
    old_long = req("old_long", prompt(400, 1))  # waited 1000 tokens for 400: ratio delta 2.5
    new_short = req("new_short", prompt(50, 2))  # waited 100 for 50: 2
    hit = req("hit", cached[:90] + prompt(30, 3))  # waited 100 for 30 uncached: 3.33
    whole = req("b_whole", list(cached[:60]))  # everything but the last token cached: still 1 uncached
    old_long.queue_entry_tokens = 0
    new_short.queue_entry_tokens = hit.queue_entry_tokens = whole.queue_entry_tokens = 900
    assert ordered(sched, [new_short, old_long, hit, whole]) == ["b_whole", "hit", "old_long", "new_short"]


def test_hrrn_ties_go_by_rid_and_the_cutoff_applies() -> None:
    sched = make_scheduler(schedule_policy="hrrn")
    queue = [req("b", prompt(10, 1)), req("a", prompt(10, 2))]
    assert ordered(sched, queue) == ["a", "b"]
    deep = [req("z", prompt(10, 3)), *cold(LPM_FALLBACK_QUEUE_LEN)]
    assert ordered(sched, deep)[0] == "z"  # 129 waiting: FCFS


def test_hrrn_counts_the_prefill_tokens_of_planned_steps() -> None:
    sched = make_scheduler(schedule_policy="hrrn")
    sched.add_request("a", prompt(100, 1), req("x").params)
    sched.next_plan()
    assert sched.queue_clock.prefill_tokens == 100
    sched.add_request("b", prompt(10, 2), req("x").params)
    assert sched.requests["b"].queue_entry_tokens == 100


# --- shortest-prefill-first --------------------------------------------------------------------------


def test_spf_orders_by_uncached_tokens_then_entry() -> None:
    sched = make_scheduler(schedule_policy="shortest-prefill-first")
    cached = prompt(100, seed=7)
    cache(sched, cached)
    queue = [
        req("long", prompt(80, 1), t=1),
        req("hit", cached[:90] + prompt(30, 3), t=2),  # 30 uncached
        req("short_late", prompt(30, 2), t=4),
        req("short_early", prompt(30, 4), t=3),
    ]
    assert ordered(sched, queue) == ["hit", "short_early", "short_late", "long"]


def test_spf_has_no_cutoff_and_needs_the_cache() -> None:
    sched = make_scheduler(schedule_policy="shortest-prefill-first")
    queue = [*cold(DEEP), req("tiny", prompt(3, 1), t=DEEP + 1)]
    assert ordered(sched, queue)[0] == "tiny"
    with pytest.raises(ValueError, match="shortest-prefill-first requires the radix cache"):
        make_scheduler(schedule_policy="shortest-prefill-first", disable_radix_cache=True)


# --- lpm-aging ---------------------------------------------------------------------------------------


def test_lpm_aging_lets_a_long_wait_pass_a_long_match() -> None:
    sched = make_scheduler(schedule_policy="lpm-aging", lpm_aging_tokens_per_s=100.0)
    cached = prompt(100, seed=7)
    cache(sched, cached)
    sched.queue_clock.busy_s = 10.0
    hit = req("hit", cached[:90] + prompt(5, 1))  # 90 + 100 × 0.5 s
    waited = req("waited", prompt(20, 2))  # 0 + 100 × 1.5 s
    fresh = req("fresh", prompt(20, 3))  # 0 + 100 × 0.1 s
    hit.queue_entry_s, waited.queue_entry_s, fresh.queue_entry_s = 9.5, 8.5, 9.9
    assert ordered(sched, [fresh, hit, waited]) == ["waited", "hit", "fresh"]
    waited.queue_entry_s = 9.5
    assert ordered(sched, [fresh, hit, waited]) == ["hit", "waited", "fresh"]


# --- the starvation bound ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy", ["fcfs", "lpm", "lof", "dfs-weight", "hrrn", "shortest-prefill-first", "lpm-aging"]
)
def test_overdue_requests_go_first_in_arrival_order(policy: str) -> None:
    sched = make_scheduler(schedule_policy=policy, max_queue_wait_s=2.0)
    cached = prompt(100, seed=7)
    cache(sched, cached)
    sched.queue_clock.busy_s = 10.0
    hit = req("hit", cached[:90] + prompt(5, 1), max_new=900, t=5)
    late2 = req("late2", prompt(300, 2), t=2)
    late1 = req("late1", prompt(400, 3), t=1)
    fresh = req("fresh", prompt(20, 4), t=6)
    for r, entry in ((hit, 9.0), (late2, 7.5), (late1, 7.9), (fresh, 9.9)):
        r.queue_entry_s = entry
    out = ordered(sched, [fresh, hit, late2, late1])
    assert out[:2] == ["late1", "late2"]
    assert sorted(out[2:]) == ["fresh", "hit"]


def test_the_queue_clock_is_the_workers_busy_time() -> None:
    sched = make_scheduler(max_queue_wait_s=1.0)
    sched.add_request("a", prompt(10, 1), req("x").params)
    plan = sched.next_plan()
    assert plan is not None
    result = FakeWorker(4096, vocab=1000).run(plan)
    sched.apply_result(dataclasses.replace(result, forward_s=0.25))
    assert sched.queue_clock.busy_s == 0.25
    sched.add_request("b", prompt(10, 2), req("x").params)
    assert sched.requests["b"].queue_entry_s == 0.25
