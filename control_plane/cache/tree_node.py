"""One node of the radix cache (docs/scheduler.md#radix-cache)."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

# A heap entry: (*eviction key, push sequence number, node), flat so that heap comparisons touch ints
# directly; the unique sequence number means a node is never compared. A node tells whether an entry
# in the heap is its current one by identity (see RadixCache's lazy heap).
HeapEntry = tuple


class TreeNode:
    """A run of tokens (`key`, int64 token ids as bytes) and the KV slots that hold them (`value`, one
    per token, read-only).

    Times are ticks of the cache's logical clock, not wall time, so that eviction order is replayable.
    `heap_entry` is set exactly while the node is an evictable leaf (unlocked, childless, not root).
    """

    __slots__ = (
        "children",
        "creation_time",
        "extra_key",
        "heap_entry",
        "hit_count",
        "key",
        "last_access_time",
        "lock_ref",
        "parent",
        "priority",
        "value",
    )

    def __init__(
        self,
        key: bytes,
        value: np.ndarray,
        parent: TreeNode | None,
        now: int,
        priority: int = 0,
        extra_key: Hashable | None = None,
    ) -> None:
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = priority
        self.extra_key = extra_key
        self.heap_entry: HeapEntry | None = None

    def tokens(self) -> np.ndarray:
        """The token ids of `key` (a read-only view)."""
        return np.frombuffer(self.key, dtype=np.int64)

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.value)}, lock_ref={self.lock_ref}, children={len(self.children)})"
