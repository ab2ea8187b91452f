"""check_pool_invariants notices each kind of corruption it promises to."""

from __future__ import annotations

import pytest

from control_plane.cache.allocator import SlotAllocator
from control_plane.cache.invariants import InvariantError, check_pool_invariants
from control_plane.cache.radix import RadixCache
from tests.control_plane.cache.helpers import insert_fresh, make_cache


def populated(page_size: int = 1) -> tuple[SlotAllocator, RadixCache]:
    alloc, tree = make_cache(capacity=32, page_size=page_size)
    insert_fresh(alloc, tree, [1, 2, 3, 4])
    insert_fresh(alloc, tree, [1, 2, 7, 8])
    check_pool_invariants(alloc, tree, 0)
    return alloc, tree


def test_unaccounted_private_slots() -> None:
    alloc, tree = populated()
    alloc.alloc(3)
    with pytest.raises(InvariantError, match="!= capacity 32"):
        check_pool_invariants(alloc, tree, 0)
    check_pool_invariants(alloc, tree, 3)


def test_lock_counter_drift() -> None:
    alloc, tree = populated()
    tree.match_prefix([1, 2, 3, 4]).last_node.lock_ref = 1  # set behind the tree's back
    with pytest.raises(InvariantError):
        check_pool_invariants(alloc, tree, 0)


def test_child_with_more_locks_than_parent() -> None:
    alloc, tree = populated()
    leaf = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.inc_lock_ref(leaf)
    assert leaf.parent is not None
    leaf.parent.lock_ref = 0
    with pytest.raises(InvariantError, match="fewer locks"):
        check_pool_invariants(alloc, tree, 0)


def test_evictable_leaf_missing_from_the_heap() -> None:
    alloc, tree = populated()
    tree.match_prefix([1, 2, 7, 8]).last_node.heap_entry = None
    with pytest.raises(InvariantError, match="evictable leaves"):
        check_pool_invariants(alloc, tree, 0)


def test_tree_slot_that_is_also_free() -> None:
    alloc, tree = populated()
    alloc.free(tree.match_prefix([1, 2]).indices)
    with pytest.raises(InvariantError, match="also free"):
        check_pool_invariants(alloc, tree, -2)  # -2 squares the sums, so the ownership check speaks


def test_slot_held_by_two_nodes() -> None:
    alloc, tree = populated()
    a = tree.match_prefix([1, 2, 3, 4]).last_node
    b = tree.match_prefix([1, 2, 7, 8]).last_node
    b.value = a.value
    with pytest.raises(InvariantError, match="two tree nodes"):
        check_pool_invariants(alloc, tree, 0)


def test_node_value_not_made_of_whole_pages() -> None:
    alloc, tree = populated(page_size=2)
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    node.value = node.value[::-1].copy()
    with pytest.raises(InvariantError, match="whole pages"):
        check_pool_invariants(alloc, tree, 0)
