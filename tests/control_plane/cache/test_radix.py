"""RadixCache behaviours of docs/scheduler.md#radix-cache and #sglang-tests (test_radix_cache_unit's
assertions)."""

from __future__ import annotations

import numpy as np
import pytest

from control_plane.cache.invariants import check_pool_invariants
from control_plane.cache.radix import RadixCache
from tests.control_plane.cache.helpers import insert_fresh, make_cache


def node_count(tree: RadixCache) -> int:
    return sum(1 for _ in tree.iter_nodes()) - 1


def test_empty_tree_and_empty_key_match_nothing() -> None:
    _, tree = make_cache()
    assert tree.match_prefix([]).last_node is tree.root
    result = tree.match_prefix([1, 2, 3])
    assert len(result.indices) == 0 and result.last_node is tree.root


def test_insert_then_match_returns_the_slots() -> None:
    alloc, tree = make_cache()
    held = insert_fresh(alloc, tree, [5, 6, 7, 8])
    assert tree.match_prefix([5, 6, 7, 8, 9]).indices.tolist() == held.tolist()
    assert tree.match_prefix([5, 6]).indices.tolist() == held[:2].tolist()
    assert tree.total_size() == tree.evictable_size() == 4


def test_keys_of_any_integer_container_match_alike() -> None:
    alloc, tree = make_cache()
    insert_fresh(alloc, tree, [1, 2, 3])
    from array import array

    for key in (
        [1, 2, 3],
        (1, 2, 3),
        np.array([1, 2, 3]),
        np.array([1, 2, 3], np.int32),
        array("q", [1, 2, 3]),
    ):
        assert len(tree.match_prefix(key).indices) == 3


def test_matching_rounds_down_to_whole_pages() -> None:
    alloc, tree = make_cache(page_size=4)
    insert_fresh(alloc, tree, list(range(10)))  # only 8 tokens are page-aligned
    assert tree.total_size() == 8
    assert len(tree.match_prefix(list(range(11))).indices) == 8
    assert len(tree.match_prefix(list(range(7))).indices) == 4
    assert len(tree.match_prefix([0, 1, 2, 3, 4, 5, 99, 7]).indices) == 4  # mismatch mid-page
    assert len(tree.match_prefix([0, 1, 2]).indices) == 0


def test_insert_returns_the_length_already_cached() -> None:
    alloc, tree = make_cache()
    insert_fresh(alloc, tree, [1, 2, 3, 4])
    slots = alloc.alloc(6)
    assert slots is not None
    assert tree.insert([1, 2, 3, 4, 5, 6], slots) == 4
    assert tree.insert([1, 2, 9], alloc.alloc(3)) == 2


def test_match_inside_a_node_splits_it_and_keeps_sizes() -> None:
    alloc, tree = make_cache()
    held = insert_fresh(alloc, tree, [1, 2, 3, 4, 5, 6])
    result = tree.match_prefix([1, 2, 3, 9])
    assert result.indices.tolist() == held[:3].tolist()
    assert node_count(tree) == 2
    assert result.last_node.tokens().tolist() == [1, 2, 3]
    (lower,) = result.last_node.children.values()
    assert lower.tokens().tolist() == [4, 5, 6] and lower.parent is result.last_node
    assert tree.total_size() == 6
    check_pool_invariants(alloc, tree, 0)


def test_paged_split_happens_at_a_page_boundary() -> None:
    alloc, tree = make_cache(page_size=4)
    insert_fresh(alloc, tree, list(range(12)))
    insert_fresh(alloc, tree, [*range(6), 60, 61])  # diverges inside the second page
    upper = tree.match_prefix(list(range(4))).last_node
    assert upper.tokens().tolist() == [0, 1, 2, 3]
    assert sorted(len(c.value) for c in upper.children.values()) == [4, 8]
    check_pool_invariants(alloc, tree, 0)


def test_split_node_inherits_locks() -> None:
    alloc, tree = make_cache()
    insert_fresh(alloc, tree, [1, 2, 3, 4])
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.inc_lock_ref(node)
    upper = tree.match_prefix([1, 2]).last_node
    assert upper.lock_ref == node.lock_ref == 1
    assert tree.protected_size() == 4 and tree.evictable_size() == 0
    tree.dec_lock_ref(node)
    assert upper.lock_ref == 0 and tree.evictable_size() == 4
    check_pool_invariants(alloc, tree, 0)


def test_lock_ref_moves_sizes_between_evictable_and_protected() -> None:
    alloc, tree = make_cache()
    insert_fresh(alloc, tree, [1, 2, 3, 4])
    insert_fresh(alloc, tree, [1, 2, 7, 8])  # the tree is now [1,2] -> {[3,4], [7,8]}
    leaf = tree.match_prefix([1, 2, 7, 8]).last_node
    assert tree.inc_lock_ref(leaf) == -4
    assert (tree.protected_size(), tree.evictable_size()) == (4, 2)
    assert tree.inc_lock_ref(leaf) == 0  # a second lock moves nothing
    assert tree.dec_lock_ref(leaf) == 0
    assert tree.dec_lock_ref(leaf) == 4
    assert (tree.protected_size(), tree.evictable_size()) == (0, 6)
    with pytest.raises(ValueError):
        tree.dec_lock_ref(leaf)


def test_evict_frees_whole_leaves_and_shrinks_the_tree() -> None:
    alloc, tree = make_cache(capacity=16)
    insert_fresh(alloc, tree, [1, 2, 3, 4])
    insert_fresh(alloc, tree, [9, 8])
    assert alloc.available_size() == 10
    assert tree.evict(1) == 4  # whole node, overshooting; the least recently used first
    assert alloc.available_size() == 14 and tree.total_size() == 2
    assert len(tree.match_prefix([1, 2]).indices) == 0
    check_pool_invariants(alloc, tree, 0)


def test_evicting_children_exposes_the_parent() -> None:
    alloc, tree = make_cache(capacity=16)
    insert_fresh(alloc, tree, [1, 2, 3, 4])
    insert_fresh(alloc, tree, [1, 2, 5, 6])
    assert tree.evict(100) == 6
    assert node_count(tree) == 0 and alloc.available_size() == 16
    check_pool_invariants(alloc, tree, 0)


def test_locked_paths_are_never_evicted() -> None:
    alloc, tree = make_cache(capacity=16)
    insert_fresh(alloc, tree, [1, 2, 3, 4])
    insert_fresh(alloc, tree, [1, 2, 5, 6])
    tree.inc_lock_ref(tree.match_prefix([1, 2, 3, 4]).last_node)
    assert tree.evict(100) == 2  # only [5, 6]; [1, 2] is an ancestor of the lock
    assert tree.evict(100) == 0
    assert tree.protected_size() == 4
    check_pool_invariants(alloc, tree, 0)


def test_evicted_nodes_cannot_be_locked() -> None:
    alloc, tree = make_cache()
    insert_fresh(alloc, tree, [1, 2])
    stale = tree.match_prefix([1, 2]).last_node
    tree.evict(2)
    with pytest.raises(ValueError):
        tree.inc_lock_ref(stale)


def test_match_results_are_read_only_views() -> None:
    alloc, tree = make_cache()
    insert_fresh(alloc, tree, [1, 2])
    indices = tree.match_prefix([1, 2]).indices
    with pytest.raises(ValueError):
        indices[0] = 99


def test_extra_key_namespaces_never_share_nodes() -> None:
    alloc, tree = make_cache()
    slots = alloc.alloc(3)
    assert tree.insert([1, 2, 3], slots, extra_key="salt-a") == 0
    assert len(tree.match_prefix([1, 2, 3]).indices) == 0
    assert len(tree.match_prefix([1, 2, 3], extra_key="salt-b").indices) == 0
    assert len(tree.match_prefix([1, 2, 3, 4], extra_key="salt-a").indices) == 3
    more = alloc.alloc(3)
    assert more is not None
    assert tree.insert([1, 2, 9], more, extra_key="salt-a") == 2  # splits inside the namespace
    alloc.free(more[:2])
    assert tree.evict(100) == 4
    check_pool_invariants(alloc, tree, 0)


def test_disabled_cache_stores_and_matches_nothing() -> None:
    alloc, tree = make_cache(disable=True)
    slots = alloc.alloc(4)
    assert slots is not None
    assert tree.insert([1, 2, 3, 4], slots) == 0
    result = tree.match_prefix([1, 2, 3, 4])
    assert len(result.indices) == 0 and result.last_node is tree.root
    assert tree.inc_lock_ref(result.last_node) == 0
    assert tree.evictable_size() == tree.protected_size() == tree.evict(10) == 0


def test_simulated_tree_needs_no_allocator() -> None:
    # docs/scheduler.md#in-batch-prefix-dedup: a simulated tree, whose values stand in for slots.
    tree = RadixCache(None)
    assert tree.insert([4, 5, 6]) == 0
    assert tree.insert([4, 5, 7]) == 2
    assert tree.match_prefix([4, 5, 6, 1]).indices.tolist() == [4, 5, 6]
    assert tree.evict(100) == 4


def test_reset_frees_every_slot_but_refuses_while_locked() -> None:
    alloc, tree = make_cache(capacity=16, page_size=2)
    insert_fresh(alloc, tree, [1, 2, 3, 4])
    insert_fresh(alloc, tree, [1, 2, 7, 8])
    node = tree.match_prefix([1, 2]).last_node
    tree.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        tree.reset()
    tree.dec_lock_ref(node)
    tree.reset()
    assert tree.total_size() == 0 and alloc.available_size() == 16 and node_count(tree) == 0
    check_pool_invariants(alloc, tree, 0)


def test_allocator_page_size_must_match() -> None:
    alloc, _ = make_cache(page_size=4)
    with pytest.raises(ValueError):
        RadixCache(alloc, page_size=1)


def test_access_times_come_from_a_logical_clock() -> None:
    def eviction_trace() -> list[list[int]]:
        alloc, tree = make_cache(capacity=32)
        for key in ([1, 2], [3, 4], [5, 6], [7, 8]):
            insert_fresh(alloc, tree, key)
        tree.match_prefix([3, 4])
        tree.match_prefix([1, 2])
        trace = []
        while tree.total_size():
            tree.evict(1)
            trace.append(alloc.free_pages()[-2:].tolist())
        return trace

    assert eviction_trace() == eviction_trace() == [[4, 5], [6, 7], [2, 3], [0, 1]]
