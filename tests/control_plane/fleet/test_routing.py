"""Cache-aware routing: the longest cached prefix wins unless the load is imbalanced; the lookup that
decides it leaves every tree as it was."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.cache.radix import RadixCache, as_token_bytes
from control_plane.config import RoutingConfig
from control_plane.core.fleet import Router


@dataclass
class _Limits:
    worker_id: str
    role: str = "mixed"


@dataclass
class _Kv:
    tree: RadixCache


@dataclass
class _Scheduler:
    kv: _Kv


@dataclass
class FakeEngine:
    """What the router reads of an engine: its id, its load and its worker's radix tree."""

    worker_id: str
    queued: int = 0
    running: int = 0
    page_size: int = 1
    cached: list[list[int]] = field(default_factory=list)
    # False while the worker drains or moves away, or once its loop has ended (the router skips it).
    serving: bool = True

    def __post_init__(self) -> None:
        self.limits = _Limits(self.worker_id)
        tree = RadixCache(None, page_size=self.page_size)
        for prompt in self.cached:
            tree.insert(prompt)
        self.scheduler = _Scheduler(_Kv(tree))

    def load(self) -> tuple[int, int]:
        return self.queued, self.running


def router(*engines: FakeEngine, routing: RoutingConfig | None = None) -> Router:
    r = Router("m", routing=routing)
    for engine in engines:
        r.engines[engine.worker_id] = engine  # type: ignore[assignment]
    return r


SYSTEM = list(range(100, 164))  # a 64-token shared system prompt


def ids(tokens: list[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def test_the_worker_caching_the_prefix_wins_over_the_idler_one():
    a = FakeEngine("a", running=10)
    b = FakeEngine("b", running=12, cached=[[*SYSTEM, 1, 2, 3]])
    r = router(a, b)
    assert r.pick("", ids([*SYSTEM, 7, 8])) is b
    assert r.decisions["cache"] == 1


def test_an_engine_that_is_not_serving_gets_nothing_new():
    """Leaving, or its loop ended (its session's last message still going out): skipped, however
    idle it looks, also as the successor of a lost worker."""
    closed = FakeEngine("a", serving=False)
    busy = FakeEngine("b", running=50, cached=[SYSTEM])
    r = router(closed, busy)
    assert r.pick("", ids([*SYSTEM, 1])) is busy and r.pick() is busy and r.pick("key") is busy
    assert r.successor(busy) is None  # type: ignore[arg-type]
    assert router(closed).pick() is None


def test_the_longest_match_wins_and_ties_go_to_the_less_loaded():
    a = FakeEngine("a", running=3, cached=[SYSTEM[:32]])
    b = FakeEngine("b", running=5, cached=[SYSTEM])
    c = FakeEngine("c", running=4, cached=[SYSTEM])
    assert router(a, b, c).pick("", ids([*SYSTEM, 9])) is c


def test_no_cached_prefix_anywhere_goes_to_the_least_loaded():
    a = FakeEngine("a", running=5, cached=[[1, 2, 3]])
    b = FakeEngine("b", running=2, cached=[[4, 5, 6]])
    r = router(a, b)
    assert r.pick("", ids([7, 8, 9])) is b
    assert r.decisions["load"] == 1


def test_an_imbalance_past_both_thresholds_goes_to_the_least_loaded():
    hot = FakeEngine("hot", running=100, cached=[SYSTEM])
    cold = FakeEngine("cold", running=30)
    r = router(hot, cold)
    # gap 70 > 64 and 100 > 1.5 * 30: imbalanced.
    assert r.pick("", ids(SYSTEM)) is cold
    assert r.decisions["balance"] == 1
    # 100 > 1.5 * 60 but the gap is only 40: not imbalanced, the cache wins.
    cold.running = 60
    assert r.pick("", ids(SYSTEM)) is hot
    cold.running, hot.running = 70, 140  # gap 70 > 64, 140 > 105: imbalanced again
    assert r.pick("", ids(SYSTEM)) is cold


def test_a_gap_within_the_absolute_threshold_keeps_the_cache_choice():
    hot = FakeEngine("hot", running=60, cached=[SYSTEM])
    cold = FakeEngine("cold", running=0)  # 60 > 1.5 * 0, but the gap is only 60
    assert router(hot, cold).pick("", ids(SYSTEM)) is hot


def test_least_loaded_policy_ignores_the_cache():
    a = FakeEngine("a", running=1, cached=[SYSTEM])
    b = FakeEngine("b", running=0)
    r = router(a, b, routing=RoutingConfig(cache_aware=False))
    assert r.pick("", ids(SYSTEM)) is b


def test_a_routing_key_keeps_its_worker_whatever_the_cache_says():
    a = FakeEngine("a", cached=[SYSTEM])
    b = FakeEngine("b", cached=[SYSTEM])
    r = router(a, b)
    chosen = {r.pick(f"user-{i}", ids(SYSTEM)).worker_id for i in range(20)}  # type: ignore[union-attr]
    assert chosen == {"a", "b"}  # keys spread over both
    for i in range(20):
        first = r.pick(f"user-{i}", ids(SYSTEM))
        assert r.pick(f"user-{i}", ids([1])) is first


def test_matches_are_whole_pages():
    a = FakeEngine("a", page_size=16, cached=[SYSTEM])
    tree = a.scheduler.kv.tree
    assert tree.cached_len(as_token_bytes([*SYSTEM[:40], 0])) == 32
    assert tree.cached_len(as_token_bytes(SYSTEM[:15])) == 0


prompts_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(cached=prompts_st, query=st.lists(st.integers(0, 3), max_size=14), page=st.sampled_from([1, 2, 4]))
def test_cached_len_is_what_a_match_finds_and_touches_nothing(cached, query, page):
    tree = RadixCache(None, page_size=page)
    for prompt in cached:
        tree.insert(prompt[: len(prompt) - len(prompt) % page])
    before = _shape(tree)
    found = tree.cached_len(as_token_bytes(query))
    assert _shape(tree) == before  # no split, no access time
    assert found == len(tree.match_prefix(query).indices)


def _shape(tree: RadixCache) -> list[tuple[bytes, int, int]]:
    return sorted((n.key, n.last_access_time, len(n.children)) for n in tree.iter_nodes())
