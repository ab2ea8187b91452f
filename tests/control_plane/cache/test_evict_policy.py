"""Each eviction strategy's order and priority tuple (docs/scheduler.md#locks-and-eviction; SGLang's
test_evict_policy)."""

from __future__ import annotations

import numpy as np
import pytest

from control_plane.cache.allocator import SlotAllocator
from control_plane.cache.evict_policy import EVICTION_POLICIES, eviction_key_fn
from control_plane.cache.invariants import check_pool_invariants
from control_plane.cache.radix import RadixCache
from tests.control_plane.cache.helpers import insert_fresh, make_cache

A, B, C = [10, 11], [20, 21], [30, 31]


def build(policy: str) -> tuple[SlotAllocator, RadixCache, dict[int, str]]:
    """Three leaves under the root, with (clock ticks):
    created A@1 B@2 C@3; A re-inserted @4 and @5 (2 hits); C re-inserted @6 (1 hit); B matched @7 (0 hits);
    priorities A=3, B=1, C=5."""
    alloc, tree = make_cache(capacity=32, policy=policy)
    owner = {}
    for name, key, priority in (("A", A, 3), ("B", B, 1), ("C", C, 5)):
        owner[int(insert_fresh(alloc, tree, key, priority)[0])] = name
    insert_fresh(alloc, tree, A)
    insert_fresh(alloc, tree, A)
    insert_fresh(alloc, tree, C)
    tree.match_prefix(B)
    return alloc, tree, owner


def eviction_order(alloc: SlotAllocator, tree: RadixCache, owner: dict[int, str]) -> list[str]:
    order = []
    while tree.total_size():
        assert tree.evict(1) == 2
        order.append(owner[int(np.min(alloc.free_pages()[-2:]))])
        check_pool_invariants(alloc, tree, 0)
    return order


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("lru", "ACB"),  # last access: A@5 < C@6 < B@7
        ("mru", "BCA"),
        ("fifo", "ABC"),  # creation
        ("filo", "CBA"),
        ("lfu", "BCA"),  # (hits, last access): B(0) < C(1) < A(2)
        ("slru", "CBA"),  # (hits >= 2, last access): C@6, B@7 in the probation segment, then A
        ("priority", "BAC"),  # (priority, last access): B=1 < A=3 < C=5
    ],
)
def test_eviction_order(policy: str, expected: str) -> None:
    alloc, tree, owner = build(policy)
    assert "".join(eviction_order(alloc, tree, owner)) == expected


def test_priority_tuples() -> None:
    _, tree, _ = build("lru")
    a = tree.match_prefix(A).last_node
    a.last_access_time, a.creation_time, a.hit_count, a.priority = 7, 2, 2, 3
    keys = {name: fn(a) for name, fn in EVICTION_POLICIES.items()}
    assert keys == {
        "lru": (7,),
        "lfu": (2, 7),
        "fifo": (2,),
        "mru": (-7,),
        "filo": (-2,),
        "priority": (3, 7),
        "slru": (1, 7),
    }


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy"):
        eviction_key_fn("random")


def test_a_touched_leaf_moves_back_in_lru_order() -> None:
    alloc, tree = make_cache(capacity=32)
    first = insert_fresh(alloc, tree, [1, 2])
    insert_fresh(alloc, tree, [3, 4])
    tree.match_prefix([1, 2])  # its heap entry is now stale-low: re-pushed when popped
    tree.evict(1)
    assert len(tree.match_prefix([1, 2]).indices) == 2
    assert len(tree.match_prefix([3, 4]).indices) == 0
    assert not alloc.is_free(first).any()


@pytest.mark.parametrize("policy", ["mru", "lru"])
def test_stale_heap_entries_stay_bounded(policy: str) -> None:
    alloc, tree = make_cache(capacity=64, policy=policy)
    keys = [[i, i] for i in range(8)]
    for key in keys:
        insert_fresh(alloc, tree, key)
    for round_ in range(500):  # every touch lowers an mru key: a fresh entry each time
        tree.match_prefix(keys[round_ % 8])
    assert len(tree.heap_entries()) <= 2 * tree.live_leaf_count() + 64
    check_pool_invariants(alloc, tree, 0)


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
@pytest.mark.parametrize("via", ["match", "insert"])
def test_splitting_a_touched_leaf_keeps_the_heap_exact(policy: str, via: str) -> None:
    """The lower half of a split keeps the access that split it (as in SGLang), which lowers its key
    under mru-like policies: the heap must learn about it at once."""
    alloc, tree = make_cache(capacity=32, policy=policy)
    insert_fresh(alloc, tree, [1, 2, 3, 4])
    insert_fresh(alloc, tree, [5, 6])
    if via == "match":
        tree.match_prefix([1, 2])
    else:
        insert_fresh(alloc, tree, [1, 2])
    check_pool_invariants(alloc, tree, 0)
    assert tree.evict(100) == 6
    check_pool_invariants(alloc, tree, 0)
