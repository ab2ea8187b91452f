"""Integrity checks of the KV pool and the radix cache (docs/scheduler.md#data-model's pool invariant, and
more).

Run after every step in tests and whenever the scheduler is idle. Every check is read-only. The work is
O(tree nodes + cached slots + pages handed out since the pool was cleared), never O(capacity): pages
that were never handed out are not looked at one by one. `PoolCheck` does the work in bounded slices,
so that an idle check never blocks the event loop for long; `check_pool_invariants` runs one to the end.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np

from control_plane.cache.allocator import SlotAllocator
from control_plane.cache.radix import RadixCache
from control_plane.cache.tree_node import HeapEntry, TreeNode

# Work units, measured so that one unit costs about 0.3 µs or less and `run(4096)` stays near 1 ms.
NODE_COST = 12  # one tree node: a few Python-level checks
HEAP_ENTRY_COST = 4  # one current heap entry: an eviction key compared
STALE_ENTRY_COST = 1  # one stale heap entry: an identity test
BATCHED_VALUE_COST = 2  # one small node value joined into a batch (numpy's per-array overhead)
ARRAY_STEP_COST = 128  # one numpy check of a chunk of ids: the fixed cost of its dozen numpy calls
SLOTS_PER_UNIT = 8  # slot or page ids checked with numpy, per unit (on top of ARRAY_STEP_COST)
SCAN_PER_UNIT = 1024  # free marks counted with numpy, per unit
CHUNK = 4096  # the most ids one step checks, so that no step is long
MAX_BATCH = 256  # the most small node values joined in one step
SCAN_CHUNK = 1 << 18  # the most free marks one step counts
MAX_STEP_COST = max(ARRAY_STEP_COST + CHUNK // SLOTS_PER_UNIT, MAX_BATCH * BATCHED_VALUE_COST, NODE_COST)


class InvariantError(AssertionError):
    """The allocator and the tree disagree about who owns which slots, or the tree is malformed."""


def check_pool_invariants(allocator: SlotAllocator, tree: RadixCache, private_slots: int) -> None:
    """Raise InvariantError unless the pool adds up and the tree is consistent (`PoolCheck`, in one go).

    `private_slots` is what running requests hold outside the tree, counted in whole pages: a request
    with positions [0, n) and protected length p holds ceil(n / P)·P − p private slots.
    """
    PoolCheck(allocator, tree, private_slots).run(sys.maxsize)


class PoolCheck:
    """One full integrity check of `allocator` and `tree`, done in slices by `run(budget)`.

    Checks that the pool adds up (free + evictable + protected + private = capacity), that the free list
    and its marks agree and hold no page twice, the tree's locks and size counters, that exactly the
    evictable leaves are in the eviction heap with keys no higher than their current ones, that node
    values are whole pages reachable from their parents, that no slot is held by two nodes, and that no
    tree slot is free.

    Read-only. The caller must not change the allocator, the tree or the private slot count between the
    first and the last `run` of one PoolCheck (it may abandon the check at any point and start a new one
    later). On state that changed mid-check the outcome is meaningless: a spurious InvariantError, a
    missed violation, or a RuntimeError from a dict that changed size. Scratch memory is one bit per
    page handed out since the last clear, plus O(evictable leaves + tree depth + CHUNK).
    """

    def __init__(self, allocator: SlotAllocator, tree: RadixCache, private_slots: int) -> None:
        self.allocator = allocator
        self.tree = tree
        self.private_slots = private_slots
        self._steps = self._all_steps()
        self._finished = False
        self._error: Exception | None = None
        self._seen = _PageSet(0)  # pages on the free list or in the tree, so far
        self._foreign_seen: set[int] = set()  # slots seen in a tree that uses another allocator
        self._leaves: set[int] = set()  # ids of the evictable leaves found by the walk
        self._pending: list[np.ndarray] = []  # small node values waiting to be checked in one batch
        self._pending_len = 0
        self._protected = self._evictable = 0

    @property
    def finished(self) -> bool:
        """Whether the whole check has completed without finding a violation."""
        return self._finished

    def run(self, budget: int) -> bool:
        """Do the next `budget` units of the check and return whether the whole check has completed.

        A call does at least one step and stops after the step that reaches `budget`, so it does at most
        budget + MAX_STEP_COST units (see the cost constants: a unit is about 0.3 µs or less). Returns
        True on every call once completed. Raises InvariantError on a violation (any other error only
        on state that changed mid-check), and the same error on every later call. Mutates only this
        object's cursors.
        """
        if self._error is not None:
            raise self._error
        if self._finished:
            return True
        spent = 0
        try:
            while True:
                spent += next(self._steps)
                if spent >= budget:
                    return False
        except StopIteration:
            self._finished = True
            return True
        except Exception as error:  # the generator is dead now: it must never look finished
            self._error = error
            raise

    # ---- the steps: each yields the units it just spent ----------------------------------------

    def _all_steps(self) -> Iterator[int]:
        yield from self._check_free_list()
        self._check_accounting()
        yield from self._walk_tree()
        self._check_totals()
        yield from self._check_heap()

    def _check_free_list(self) -> Iterator[int]:
        """The queue of freed pages holds distinct pages below the watermark, exactly the marked ones."""
        alloc = self.allocator
        self._seen = _PageSet(alloc.watermark)
        queued = alloc.recycled_page_count()
        for start in range(0, queued, CHUNK):
            pages = alloc.recycled_pages(start, start + CHUNK)
            self._check_queued(pages)
            yield ARRAY_STEP_COST + len(pages) // SLOTS_PER_UNIT
        marked = 0
        for start in range(0, alloc.watermark, SCAN_CHUNK):
            stop = min(start + SCAN_CHUNK, alloc.watermark)
            marked += alloc.count_free_pages(start, stop)
            yield 1 + (stop - start) // SCAN_PER_UNIT
        if marked != queued:
            _fail(f"the free list and the free-page bitmap disagree: {queued} queued, {marked} marked")

    def _check_queued(self, pages: np.ndarray) -> None:
        alloc = self.allocator
        if len(pages) and (pages.min() < 0 or pages.max() >= alloc.num_pages):
            _fail("the free list holds page ids outside the pool")
        if (pages >= alloc.watermark).any():
            _fail("a page is on the free list twice (queued and never handed out)")
        if not alloc.is_free(pages * alloc.page_size).all():
            _fail("the free list and the free-page bitmap disagree")
        if not self._seen.add_new(pages):
            _fail("a page is on the free list twice")

    def _check_accounting(self) -> None:
        alloc, tree = self.allocator, self.tree
        available, evictable, protected = alloc.available_size(), tree.evictable_size(), tree.protected_size()
        total = available + evictable + protected + self.private_slots
        if total != alloc.capacity:
            _fail(
                f"available {available} + evictable {evictable} + protected {protected} + private "
                f"{self.private_slots} = {total} != capacity {alloc.capacity}"
            )

    def _walk_tree(self) -> Iterator[int]:
        """Depth first; a frame's children iterator is its cursor, so a wide node costs one step per
        child rather than one long step."""
        root = self.tree.root
        if root.lock_ref != 1:
            _fail(f"root lock_ref {root.lock_ref} != 1")
        if root.heap_entry is not None:
            _fail("evictable leaves: the root has a heap entry")
        stack = [_Frame(root)]
        while stack:
            frame = stack[-1]
            child = next(frame.children, None)
            if child is None:
                stack.pop()
                # A lock covers the whole path to the root, so a node holds at least its children's locks.
                if frame.node is not root and frame.node.lock_ref < frame.child_locks:
                    _fail(f"{frame.node!r} has fewer locks than its children")
                continue
            frame.child_locks += child.lock_ref
            self._check_node(child)
            yield NODE_COST
            yield from self._check_value(child.value)
            stack.append(_Frame(child))
        yield from self._flush_values()

    def _check_node(self, node: TreeNode) -> None:
        """The O(1) checks of one non-root node: lock, heap flag, sizes, link to its parent."""
        if node.lock_ref < 0:
            _fail(f"negative lock_ref on {node!r}")
        if node.lock_ref > 0:
            self._protected += len(node.value)
        else:
            self._evictable += len(node.value)
        evictable_leaf = node.lock_ref == 0 and not node.children
        if evictable_leaf != (node.heap_entry is not None):
            state = "an evictable leaf" if evictable_leaf else "not an evictable leaf"
            _fail(f"evictable leaves: {node!r} is {state} but heap_entry is {node.heap_entry!r:.40}")
        if evictable_leaf:
            self._leaves.add(id(node))
        tree, page = self.tree, self.tree.page_size
        tokens = len(node.tokens())
        if len(node.value) != tokens or tokens == 0 or tokens % page:
            _fail(f"{node!r} has {tokens} tokens and {len(node.value)} slots (page {page})")
        if node.parent is None or node.parent.children.get(tree._edge_of(node)) is not node:
            _fail(f"{node!r} is not reachable from its parent by its first page")

    def _check_value(self, value: np.ndarray) -> Iterator[int]:
        """Queue a node's value for `_check_values`; small values are checked in batches, since numpy's
        per-call overhead would dominate a check per node."""
        if len(value) >= CHUNK:
            yield from self._check_values(value)
            return
        self._pending.append(value)
        self._pending_len += len(value)
        if self._pending_len >= CHUNK or len(self._pending) >= MAX_BATCH:
            yield from self._flush_values()

    def _flush_values(self) -> Iterator[int]:
        if self._pending:
            values = np.concatenate(self._pending)
            yield len(self._pending) * BATCHED_VALUE_COST
            self._pending, self._pending_len = [], 0
            yield from self._check_values(values)

    def _check_values(self, values: np.ndarray) -> Iterator[int]:
        """Whole pages, held by no other node, and not free; in chunks of whole pages. `values` is a run
        of whole node values, so every chunk boundary falls on a page boundary."""
        page = self.tree.page_size
        chunk = max(page, CHUNK // page * page)
        for start in range(0, len(values), chunk):
            part = values[start : start + chunk]
            _check_pages(part, page)
            if self.tree.allocator is self.allocator:
                self._claim_pages(part[::page] // page)
            else:
                self._claim_foreign(part)
            yield ARRAY_STEP_COST + len(part) // SLOTS_PER_UNIT

    def _claim_pages(self, pages: np.ndarray) -> None:
        alloc = self.allocator
        if len(pages) and (pages.min() < 0 or pages.max() >= alloc.num_pages):
            _fail("a tree node holds slot ids outside the pool")
        if alloc.is_free(pages * alloc.page_size).any():
            _fail("a tree-owned slot is also free in the allocator")
        # Not free, so below the watermark and not queued: a page already seen is another node's.
        if not self._seen.add_new(pages):
            _fail("a slot id is held by two tree nodes")

    def _claim_foreign(self, slots: np.ndarray) -> None:
        """A tree over another allocator (or none): only the slots' uniqueness can be checked."""
        new = set(slots.tolist())
        if len(new) != len(slots) or not self._foreign_seen.isdisjoint(new):
            _fail("a slot id is held by two tree nodes")
        self._foreign_seen |= new

    def _check_totals(self) -> None:
        tree = self.tree
        if self._protected != tree.protected_size() or self._evictable != tree.evictable_size():
            _fail(
                f"walk finds protected {self._protected}, evictable {self._evictable}; counters say "
                f"{tree.protected_size()}, {tree.evictable_size()}"
            )
        if tree.live_leaf_count() != len(self._leaves):
            _fail(f"live leaf count {tree.live_leaf_count()} != {len(self._leaves)}")

    def _check_heap(self) -> Iterator[int]:
        """Each evictable leaf has exactly one current heap entry, with a key ≤ its current key."""
        expected = len(self._leaves)
        # The heap itself, not the copy heap_entries() makes: a copy would be one O(nodes) step. It is
        # only read, and the caller keeps the tree unchanged until the check ends.
        heap: list[HeapEntry] = self.tree._heap
        for index in range(len(heap)):
            entry = heap[index]
            node = entry[-1]
            if node.heap_entry is not entry:
                yield STALE_ENTRY_COST
                continue
            if id(node) not in self._leaves:
                _fail(f"evictable leaves: expected {expected}; a current heap entry is not one of them")
            self._leaves.discard(id(node))
            # The lazy heap is only correct while no entry's key exceeds its node's current key.
            if entry[:-2] > self.tree.eviction_key(node):
                _fail(f"heap key {entry[:-2]} above current key of {node!r}")
            yield HEAP_ENTRY_COST
        if self._leaves:
            _fail(f"evictable leaves: expected {expected}, in heap {expected - len(self._leaves)}")


class _Frame:
    """A node on the walk's stack, with the cursor over its children and the sum of their locks."""

    __slots__ = ("child_locks", "children", "node")

    def __init__(self, node: TreeNode) -> None:
        self.node = node
        self.children: Iterator[TreeNode] = iter(node.children.values())
        self.child_locks = 0


class _PageSet:
    """A set of page ids in [0, size), one bit each; `add_new` tells whether any was already in it."""

    def __init__(self, size: int) -> None:
        self._bits = np.zeros((size + 7) // 8, dtype=np.uint8)

    def add_new(self, pages: np.ndarray) -> bool:
        """Mutates: adds `pages` (ids in [0, size)). False if one was already present or is repeated."""
        if len(pages) == 0:
            return True
        pages = np.sort(pages)
        if (pages[1:] == pages[:-1]).any():
            return False
        byte = pages >> 3
        bit = np.left_shift(1, pages & 7).astype(np.uint8)
        if (self._bits[byte] & bit).any():
            return False
        firsts = np.flatnonzero(np.concatenate(([True], byte[1:] != byte[:-1])))
        self._bits[byte[firsts]] |= np.bitwise_or.reduceat(bit, firsts)
        return True


def _fail(message: str) -> None:
    raise InvariantError(message)


def _check_pages(value: np.ndarray, page: int) -> None:
    """Each run of `page` slots must be one whole page, in offset order."""
    if page == 1:
        return
    runs = value.reshape(-1, page)
    if (runs[:, 0] % page).any() or (runs - runs[:, :1] != np.arange(page)).any():
        _fail(f"node value is not made of whole pages: {value[: 2 * page].tolist()}...")
