"""PoolCheck: the integrity check in bounded slices catches every corruption the one-shot check does."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from control_plane.cache.allocator import SlotAllocator
from control_plane.cache.invariants import InvariantError, PoolCheck, check_pool_invariants
from control_plane.cache.radix import RadixCache
from control_plane.cache.tree_node import TreeNode
from tests.control_plane.cache.helpers import insert_fresh, make_cache

Pool = tuple[SlotAllocator, RadixCache]


def populated(page_size: int = 1) -> Pool:
    """The two keys test_invariants corrupts, among ~150 other nodes and a non-empty queue of freed
    pages, so that a check takes many slices and a corruption is found mid-check."""
    alloc, tree = make_cache(capacity=4096 * page_size, page_size=page_size)
    for i in range(150):
        insert_fresh(alloc, tree, [100 + i % 20, 1000 + i, *[5] * (i % 9)])
    tree.evict(12)
    insert_fresh(alloc, tree, [1, 2, 3, 4])
    insert_fresh(alloc, tree, [1, 2, 7, 8])
    check_pool_invariants(alloc, tree, 0)
    return alloc, tree


LONG_A, LONG_B = [1, *range(10, 5009)], [2, *range(10, 5009)]


def long_values() -> Pool:
    """Two nodes longer than a check step's chunk of ids."""
    alloc, tree = make_cache(capacity=16384)
    insert_fresh(alloc, tree, LONG_A)
    insert_fresh(alloc, tree, LONG_B)
    return alloc, tree


def node(tree: RadixCache, key: list[int]) -> TreeNode:
    """The node that `key` ends in (a match that ends inside a node would split it)."""
    return tree.match_prefix(key).last_node


# Each corruption mutates a pool and returns the private slot count to check it with.
def private_slots_unaccounted(alloc: SlotAllocator, tree: RadixCache) -> int:
    alloc.alloc(3)
    return 0


def lock_counter_drift(alloc: SlotAllocator, tree: RadixCache) -> int:
    node(tree, [1, 2, 3, 4]).lock_ref = 1
    return 0


def child_with_more_locks(alloc: SlotAllocator, tree: RadixCache) -> int:
    leaf = node(tree, [1, 2, 3, 4])
    tree.inc_lock_ref(leaf)
    assert leaf.parent is not None
    leaf.parent.lock_ref = 0
    return 0


def leaf_missing_from_heap(alloc: SlotAllocator, tree: RadixCache) -> int:
    node(tree, [1, 2, 7, 8]).heap_entry = None
    return 0


def tree_slot_also_free(alloc: SlotAllocator, tree: RadixCache) -> int:
    alloc.free(tree.match_prefix([1, 2]).indices)
    return -2


def slot_held_by_two_nodes(alloc: SlotAllocator, tree: RadixCache) -> int:
    node(tree, [1, 2, 7, 8]).value = node(tree, [1, 2, 3, 4]).value
    return 0


def value_not_whole_pages(alloc: SlotAllocator, tree: RadixCache) -> int:
    leaf = node(tree, [1, 2, 3, 4])
    leaf.value = leaf.value[::-1].copy()
    return 0


def queued_twice(alloc: SlotAllocator, tree: RadixCache) -> int:
    head = alloc._queue_head
    alloc._queue[(head + 1) % len(alloc._queue)] = alloc._queue[head]
    return 0


def marked_free_but_not_queued(alloc: SlotAllocator, tree: RadixCache) -> int:
    alloc._marks[int(node(tree, [1, 2, 3, 4]).value[0])] = True
    return 0


def queued_but_not_marked(alloc: SlotAllocator, tree: RadixCache) -> int:
    alloc._marks[int(alloc.recycled_pages(0, 1)[0])] = False
    return 0


def queued_above_watermark(alloc: SlotAllocator, tree: RadixCache) -> int:
    alloc._queue[alloc._queue_head] = alloc.watermark
    return 0


def long_value_slot_free(alloc: SlotAllocator, tree: RadixCache) -> int:
    alloc.free(node(tree, LONG_B).value[4500:4501])
    return -1


def long_values_shared(alloc: SlotAllocator, tree: RadixCache) -> int:
    node(tree, LONG_B).value = node(tree, LONG_A).value
    return 0


Corruption = Callable[[SlotAllocator, RadixCache], int]
CASES: list[tuple[Corruption, Callable[[], Pool], str]] = [
    (private_slots_unaccounted, populated, "!= capacity 4096"),
    (lock_counter_drift, populated, "evictable leaves|fewer locks|walk finds"),
    (child_with_more_locks, populated, "fewer locks"),
    (leaf_missing_from_heap, populated, "evictable leaves"),
    (tree_slot_also_free, populated, "also free"),
    (slot_held_by_two_nodes, populated, "two tree nodes"),
    (value_not_whole_pages, lambda: populated(page_size=2), "whole pages"),
    (queued_twice, populated, "on the free list twice"),
    (marked_free_but_not_queued, populated, "bitmap disagree"),
    (queued_but_not_marked, populated, "bitmap disagree"),
    (queued_above_watermark, populated, "on the free list twice"),
    (long_value_slot_free, long_values, "also free"),
    (long_values_shared, long_values, "two tree nodes"),
]
IDS = [case[0].__name__ for case in CASES]


def run_in_slices(check: PoolCheck, budget: int, limit: int = 100_000) -> int:
    """Run `check` to the end in slices of `budget`; returns the number of calls."""
    for calls in range(1, limit + 1):
        if check.run(budget):
            return calls
    raise AssertionError(f"the check did not finish in {limit} slices")


@pytest.mark.parametrize(("corrupt", "make", "match"), CASES, ids=IDS)
def test_one_shot_check_catches(corrupt: Corruption, make: Callable[[], Pool], match: str) -> None:
    alloc, tree = make()
    private = corrupt(alloc, tree)
    with pytest.raises(InvariantError, match=match):
        check_pool_invariants(alloc, tree, private)


@pytest.mark.parametrize("budget", [1, 7, 4096])
@pytest.mark.parametrize(("corrupt", "make", "match"), CASES, ids=IDS)
def test_sliced_check_catches(corrupt: Corruption, make: Callable[[], Pool], match: str, budget: int) -> None:
    alloc, tree = make()
    private = corrupt(alloc, tree)
    check = PoolCheck(alloc, tree, private)
    with pytest.raises(InvariantError, match=match):
        run_in_slices(check, budget)
    with pytest.raises(InvariantError, match=match):  # and again on every later call
        check.run(budget)
    assert not check.finished


@pytest.mark.parametrize(
    ("make", "min_steps"), [(populated, 150), (lambda: populated(page_size=4), 150), (long_values, 6)]
)
def test_a_sound_pool_passes_in_slices(make: Callable[[], Pool], min_steps: int) -> None:
    alloc, tree = make()
    calls = {budget: run_in_slices(PoolCheck(alloc, tree, 0), budget) for budget in (1, 7, 4096)}
    assert calls[1] >= calls[7] >= calls[4096] >= 1 and calls[1] > calls[4096]
    assert calls[1] >= min_steps  # every node, and every chunk of a long value, is a step of its own


def test_a_finished_check_stays_finished() -> None:
    alloc, tree = populated()
    check = PoolCheck(alloc, tree, 0)
    assert not check.finished
    run_in_slices(check, 7)
    assert check.finished and check.run(1) and check.run(0)


def test_a_check_is_read_only() -> None:
    alloc, tree = populated(page_size=2)
    before = (alloc.free_pages().tolist(), [(n.lock_ref, n.value.tolist()) for n in tree.iter_nodes()])
    heap = tree.heap_entries()
    run_in_slices(PoolCheck(alloc, tree, 0), 3)
    after = (alloc.free_pages().tolist(), [(n.lock_ref, n.value.tolist()) for n in tree.iter_nodes()])
    assert before == after and tree.heap_entries() == heap


def test_a_tree_over_another_allocator_is_checked_for_shared_slots() -> None:
    alloc = SlotAllocator(64)
    other, tree = make_cache(capacity=64)
    insert_fresh(other, tree, [1, 2, 3])
    insert_fresh(other, tree, [4, 5, 6])
    alloc.alloc(6)  # the accounting is against `alloc`
    check_pool_invariants(alloc, tree, 0)
    node(tree, [4]).value = np.array(node(tree, [1]).value)
    with pytest.raises(InvariantError, match="two tree nodes"):
        check_pool_invariants(alloc, tree, 0)
