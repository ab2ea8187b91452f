"""Waiting-queue policies (docs/scheduler.md#ordering-policies–docs/scheduler.md#in-batch-prefix-dedup;
SGLang's test_schedule_policy.py)."""

from __future__ import annotations

import pytest

from control_plane.request import Request
from control_plane.scheduler.policy import LPM_FALLBACK_QUEUE_LEN
from control_plane.scheduler.scheduler import Scheduler
from tests.control_plane.factories import make_scheduler, params, prompt


def req(
    rid: str,
    ids: list[int] | None = None,
    max_new: int = 16,
    priority: int | None = None,
    key: str = "",
    t: int = 0,
) -> Request:
    r = Request(
        rid=rid,
        origin_input_ids=ids or prompt(8, seed=sum(map(ord, rid))),
        params=params(max_new, routing_key=key),
    )
    r.max_new_tokens = max_new
    r.priority = priority
    r.wait_queue_entry_time = t
    return r


def ordered(sched: Scheduler, queue: list[Request], running: list[Request] | None = None) -> list[str]:
    sched.policy.order(queue, running or [])
    return [r.rid for r in queue]


def cache(sched: Scheduler, ids: list[int]) -> None:
    """Put `ids` into the real prefix tree, unlocked."""
    slots = sched.kv.allocator.alloc(len(ids))
    assert slots is not None
    sched.kv.tree.insert(ids, slots)


# --- resolution (docs/scheduler.md#ordering-policies)
# -------------------------------------------------------------------------------


def test_unknown_policy_raises() -> None:
    with pytest.raises(ValueError, match="Unknown schedule_policy"):
        make_scheduler(schedule_policy="priority")


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cache_aware_policy_without_cache_is_fcfs(policy: str) -> None:
    sched = make_scheduler(schedule_policy=policy, disable_radix_cache=True, chunked_prefill_size=None)
    assert type(sched.policy).__name__ == "Fcfs"
    queue = [req("a", prompt(10, 1)), req("b", prompt(50, 2)), req("c", prompt(30, 3))]
    assert ordered(sched, queue) == ["a", "b", "c"]


# --- cache-agnostic orders (docs/scheduler.md#ordering-policies)
# ---------------------------------------------------------------------


def test_fcfs_keeps_arrival_order() -> None:
    sched = make_scheduler()
    queue = [req("c", priority=5, t=3), req("a", priority=9, t=1), req("b", max_new=900, t=2)]
    assert ordered(sched, queue) == ["c", "a", "b"]


def test_fcfs_with_priority_orders_by_priority_then_entry_time() -> None:
    sched = make_scheduler(enable_priority_scheduling=True)
    queue = [req("low", priority=1, t=1), req("high_late", priority=9, t=4), req("high", priority=9, t=2)]
    assert ordered(sched, queue) == ["high", "high_late", "low"]


def test_low_priority_values_first_reverses() -> None:
    sched = make_scheduler(enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    queue = [req("low", priority=1, t=1), req("high_late", priority=9, t=4), req("high", priority=9, t=2)]
    assert ordered(sched, queue) == ["low", "high", "high_late"]


def test_lof_orders_by_max_new_tokens() -> None:
    sched = make_scheduler(schedule_policy="lof")
    queue = [
        req("s", max_new=10, t=1),
        req("l", max_new=500, t=2),
        req("m", max_new=100, t=3),
        req("m2", max_new=100),
    ]
    assert ordered(sched, queue) == ["l", "m", "m2", "s"]


def test_lof_with_priority_puts_priority_first() -> None:
    sched = make_scheduler(schedule_policy="lof", enable_priority_scheduling=True)
    queue = [
        req("p1_long", max_new=900, priority=1),
        req("p5_short", max_new=5, priority=5),
        req("p5_long", max_new=50, priority=5),
    ]
    assert ordered(sched, queue) == ["p5_long", "p5_short", "p1_long"]


def test_routing_key_prefers_the_most_frequent_running_key() -> None:
    sched = make_scheduler(schedule_policy="routing-key")
    running = [req("r1", key="b"), req("r2", key="b"), req("r3", key="a"), req("r4", key="c"), req("r5")]
    queue = [
        req("q_none"),
        req("q_z", key="z"),
        req("q_c", key="c"),
        req("q_a", key="a"),
        req("q_b", key="b"),
        req("q_y", key="y"),
    ]
    # b (2) first; a and c tie at 1 → lexicographic; non-matching last, empty key first among them.
    assert ordered(sched, queue, running) == ["q_b", "q_a", "q_c", "q_none", "q_y", "q_z"]


def test_routing_key_with_empty_running_batch_keeps_order() -> None:
    sched = make_scheduler(schedule_policy="routing-key")
    queue = [req("q_z", key="z"), req("q_a", key="a")]
    assert ordered(sched, queue, []) == ["q_z", "q_a"]
    assert ordered(sched, queue, [req("r", key="")]) == ["q_z", "q_a"]


def test_random_is_seeded() -> None:
    def shuffled(seed: int) -> list[list[str]]:
        sched = make_scheduler(schedule_policy="random", random_seed=seed)
        queue = [req(f"q{i}") for i in range(20)]
        return [ordered(sched, queue) for _ in range(3)]

    assert shuffled(7) == shuffled(7)
    assert shuffled(7) != shuffled(8)
    assert sorted(shuffled(7)[0]) == sorted(f"q{i}" for i in range(20))


# --- cache-aware orders (docs/scheduler.md#ordering-policies step 4, docs/scheduler.md#in-batch-prefix-dedup)
# ---------------------------------------------------------------


def test_lpm_orders_by_longest_cached_prefix() -> None:
    sched = make_scheduler(schedule_policy="lpm")
    base = prompt(200, seed=1)
    cache(sched, base)
    queue = [
        req("miss", prompt(100, 9)),
        req("p50", base[:50] + prompt(10, 2)),
        req("p150", base[:150] + prompt(10, 3)),
    ]
    assert ordered(sched, queue) == ["p150", "p50", "miss"]
    assert [r.num_matched_prefix_tokens for r in queue] == [150, 50, 0]


def test_lpm_match_never_covers_the_last_token() -> None:
    sched = make_scheduler(schedule_policy="lpm")
    base = prompt(64, seed=1)
    cache(sched, base)
    queue = [req("whole", list(base))]
    ordered(sched, queue)
    assert queue[0].num_matched_prefix_tokens == 63


def test_lpm_in_batch_dedup_defers_requests_sharing_an_uncached_prefix() -> None:
    sched = make_scheduler(schedule_policy="lpm")
    shared = prompt(40, seed=5)
    short_shared = prompt(20, seed=6)
    cached = prompt(100, seed=7)
    cache(sched, cached)
    queue = [
        req("first", shared + prompt(10, 1)),
        req("dup", shared + prompt(10, 2)),  # shares 40 ≥ 32 tokens with "first": deprioritized
        req("short1", short_shared + prompt(10, 3)),
        req("short2", short_shared + prompt(10, 4)),  # shares only 20: keeps its rank
        req("hit", cached[:60] + prompt(10, 8)),
    ]
    assert ordered(sched, queue) == ["hit", "first", "short1", "short2", "dup"]


def test_lpm_dedup_skips_requests_with_a_long_real_match() -> None:
    sched = make_scheduler(schedule_policy="lpm")
    cached = prompt(100, seed=7)
    cache(sched, cached)
    # Both match 60 > 32 real tokens, so neither is checked against the simulated tree.
    queue = [req("a", cached[:60] + prompt(40, 1)), req("b", cached[:60] + prompt(40, 1)[:39])]
    assert ordered(sched, queue) == ["a", "b"]


def test_lpm_dedup_can_be_disabled() -> None:
    sched = make_scheduler(schedule_policy="lpm", in_batch_prefix_check_threshold=-1)
    shared = prompt(40, seed=5)
    queue = [
        req("first", shared + prompt(10, 1)),
        req("dup", shared + prompt(10, 2)),
        req("x", prompt(20, 3)),
    ]
    assert ordered(sched, queue) == ["first", "dup", "x"]


def test_lpm_falls_back_to_fcfs_past_128_waiting() -> None:
    sched = make_scheduler(schedule_policy="lpm")
    cached = prompt(100, seed=7)
    cache(sched, cached)
    hit = req("hit", cached[:90] + prompt(5, 1))
    queue = [req(f"q{i}", prompt(10, 100 + i)) for i in range(LPM_FALLBACK_QUEUE_LEN)] + [hit]
    assert ordered(sched, list(queue))[-1] == "hit"  # 129 waiting: FCFS
    assert ordered(sched, queue[1:])[0] == "hit"  # 128 waiting: LPM


def test_dfs_weight_visits_heavier_subtrees_first() -> None:
    sched = make_scheduler(schedule_policy="dfs-weight")
    a, b = prompt(64, seed=1), prompt(64, seed=2)
    cache(sched, a)
    cache(sched, a[:32] + prompt(32, seed=3))  # splits `a` at 32: node A32 with children A64, A'64
    cache(sched, b)
    queue = [
        req("none", prompt(40, 9)),
        req("b1", b + prompt(4, 10)),
        req("a32", a[:32] + prompt(40, 11)),
        req("a64_1", a + prompt(4, 12)),
        req("a64_2", a + prompt(4, 13)),
    ]
    # Subtree A32 weighs 3 (a32, a64_1, a64_2), B weighs 1: A first; inside A the child A64 (2)
    # comes before the requests that end at A32 itself; requests without a cached prefix last.
    assert ordered(sched, queue) == ["a64_1", "a64_2", "a32", "b1", "none"]
