"""Factories for the cache tests: a pool, a tree, and a request that uses them as the scheduler would."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from control_plane.cache.allocator import SlotAllocator
from control_plane.cache.radix import RadixCache, ReqCacheState
from control_plane.cache.tree_node import TreeNode


def make_cache(
    capacity: int = 64, page_size: int = 1, policy: str = "lru", disable: bool = False
) -> tuple[SlotAllocator, RadixCache]:
    alloc = SlotAllocator(capacity, page_size)
    return alloc, RadixCache(alloc, page_size=page_size, disable=disable, eviction_policy=policy)


def insert_fresh(alloc: SlotAllocator, tree: RadixCache, tokens: list[int], priority: int = 0) -> np.ndarray:
    """Compute `tokens` into fresh slots and hand the page-aligned part to the tree (the duplicates of
    an already cached prefix, and the unaligned tail, go back to the allocator). Returns the slots the
    tree ends up holding for the key."""
    aligned = len(tokens) - len(tokens) % alloc.page_size
    slots = alloc.alloc_extend(0, -1, len(tokens))
    assert slots is not None, "pool exhausted in a test set-up"
    cached = tree.insert(tokens[:aligned], slots[:aligned], priority=priority)
    alloc.free(slots[:cached])
    alloc.free(slots[aligned:])
    return tree.match_prefix(tokens[:aligned]).indices


@dataclass
class FakeReq:
    """The cache-relevant state of one admitted request (docs/scheduler.md#data-model)."""

    tokens: list[int]
    slots: np.ndarray
    protected_len: int
    last_node: TreeNode  # holds the request's one tree lock (the root: none)
    priority: int = 0  # the tree's priority of its inserts (larger: evicted later)

    def adopt(self, state: ReqCacheState) -> None:
        """Mutates: take the slots, lock node and protected length that a cache call returned."""
        self.slots, self.last_node, self.protected_len = state.slots, state.last_node, state.protected_len

    def private_slots(self, page_size: int) -> int:
        """Slots held outside the tree, in whole pages: the last page is the request's even if partly used."""
        pages = -(-len(self.slots) // page_size)
        return pages * page_size - self.protected_len


def admit(
    alloc: SlotAllocator, tree: RadixCache, tokens: list[int], extend: int | None = None
) -> FakeReq | None:
    """Match, lock, and allocate `extend` more positions after the match (default: up to len(tokens)).
    The match never covers the last token (docs/scheduler.md#invariants). Evicts when short; None when it
    still does not fit."""
    match = tree.match_prefix(tokens[:-1])
    tree.inc_lock_ref(match.last_node)
    prefix_len = len(match.indices)
    extend = len(tokens) - prefix_len if extend is None else extend
    last_slot = int(match.indices[-1]) if prefix_len else -1
    new = alloc.alloc_extend(prefix_len, last_slot, extend)
    if new is None:
        tree.evict(extend + alloc.page_size)
        new = alloc.alloc_extend(prefix_len, last_slot, extend)
    if new is None:
        tree.dec_lock_ref(match.last_node)
        return None
    slots = np.concatenate((match.indices, new))
    return FakeReq(list(tokens), slots, prefix_len, match.last_node)


def decode(alloc: SlotAllocator, req: FakeReq, token: int) -> bool:
    """Append one token with its slot; False (nothing changed) when the pool is short."""
    slot = alloc.alloc_decode(len(req.slots), int(req.slots[-1]))
    if slot is None:
        return False
    req.tokens.append(token)
    req.slots = np.append(req.slots, slot)
    return True
