"""Integrity checks of the KV pool and the radix cache (SCHEDULER.md §0.1's pool invariant, and more).

Run after every step in tests and whenever the scheduler is idle. Every check is read-only and walks the
whole tree (O(nodes + capacity)), so it is for tests and idle time, not the hot path.
"""

from __future__ import annotations

import numpy as np

from control_plane.cache.allocator import SlotAllocator
from control_plane.cache.radix import RadixCache
from control_plane.cache.tree_node import TreeNode


class InvariantError(AssertionError):
    """The allocator and the tree disagree about who owns which slots, or the tree is malformed."""


def check_pool_invariants(allocator: SlotAllocator, tree: RadixCache, private_slots: int) -> None:
    """Raise InvariantError unless the pool adds up and the tree is consistent.

    `private_slots` is what running requests hold outside the tree, counted in whole pages: a request
    with positions [0, n) and protected length p holds ceil(n / P)·P − p private slots.
    """
    _check_allocator(allocator)
    nodes = list(tree.iter_nodes())
    _check_accounting(allocator, tree, private_slots)
    _check_locks(tree, nodes)
    _check_evictable_leaves(tree, nodes)
    _check_values(allocator, tree, nodes)


def _fail(message: str) -> None:
    raise InvariantError(message)


def _check_allocator(allocator: SlotAllocator) -> None:
    free = allocator.free_pages()
    if len(np.unique(free)) != len(free):
        _fail("a page is on the free list twice")
    marked = np.flatnonzero(allocator.is_free(np.arange(allocator.num_pages) * allocator.page_size))
    if not np.array_equal(np.sort(free), marked):
        _fail("the free list and the free-page bitmap disagree")


def _check_accounting(allocator: SlotAllocator, tree: RadixCache, private_slots: int) -> None:
    available, evictable, protected = allocator.available_size(), tree.evictable_size(), tree.protected_size()
    total = available + evictable + protected + private_slots
    if total != allocator.capacity:
        _fail(
            f"available {available} + evictable {evictable} + protected {protected} + private "
            f"{private_slots} = {total} != capacity {allocator.capacity}"
        )


def _check_locks(tree: RadixCache, nodes: list[TreeNode]) -> None:
    if tree.root.lock_ref != 1:
        _fail(f"root lock_ref {tree.root.lock_ref} != 1")
    protected = evictable = 0
    for node in nodes[1:]:
        if node.lock_ref < 0:
            _fail(f"negative lock_ref on {node!r}")
        # A lock covers the whole path to the root, so a node holds at least its children's locks.
        if node.lock_ref < sum(child.lock_ref for child in node.children.values()):
            _fail(f"{node!r} has fewer locks than its children")
        if node.lock_ref > 0:
            protected += len(node.value)
        else:
            evictable += len(node.value)
    if protected != tree.protected_size() or evictable != tree.evictable_size():
        _fail(
            f"walk finds protected {protected}, evictable {evictable}; counters say "
            f"{tree.protected_size()}, {tree.evictable_size()}"
        )


def _check_evictable_leaves(tree: RadixCache, nodes: list[TreeNode]) -> None:
    expected = {id(n) for n in nodes[1:] if n.lock_ref == 0 and not n.children}
    flagged = {id(n) for n in nodes if n.heap_entry is not None}
    live = [e for e in tree.heap_entries() if e[-1].heap_entry is e]
    if flagged != expected or {id(e[-1]) for e in live} != expected:
        _fail(f"evictable leaves: expected {len(expected)}, flagged {len(flagged)}, in heap {len(live)}")
    if tree.live_leaf_count() != len(expected):
        _fail(f"live leaf count {tree.live_leaf_count()} != {len(expected)}")
    for entry in live:
        # The lazy heap is only correct while no entry's key exceeds its node's current key.
        if entry[:-2] > tree.eviction_key(entry[-1]):
            _fail(f"heap key {entry[:-2]} above current key of {entry[-1]!r}")


def _check_values(allocator: SlotAllocator, tree: RadixCache, nodes: list[TreeNode]) -> None:
    page = tree.page_size
    for node in nodes[1:]:
        tokens = len(node.tokens())
        if len(node.value) != tokens or tokens == 0 or tokens % page:
            _fail(f"{node!r} has {tokens} tokens and {len(node.value)} slots (page {page})")
        if node.parent is None or node.parent.children.get(tree._edge_of(node)) is not node:
            _fail(f"{node!r} is not reachable from its parent by its first page")
        _check_pages(node.value, page)
    values = np.concatenate([n.value for n in nodes[1:]]) if len(nodes) > 1 else np.empty(0, np.int64)
    if len(np.unique(values)) != len(values):
        _fail("a slot id is held by two tree nodes")
    if tree.allocator is allocator and len(values) and allocator.is_free(values).any():
        _fail("a tree-owned slot is also free in the allocator")


def _check_pages(value: np.ndarray, page: int) -> None:
    """Each run of `page` slots must be one whole page, in offset order."""
    if page == 1:
        return
    runs = value.reshape(-1, page)
    if (runs[:, 0] % page).any() or (runs - runs[:, :1] != np.arange(page)).any():
        _fail(f"node value is not made of whole pages: {value[: 2 * page].tolist()}...")
