"""Eviction orders of the radix cache, by name (docs/scheduler.md#locks-and-eviction; SGLang's
`mem_cache/evict_policy.py`).

Each policy maps a node to a tuple; the leaf with the smallest tuple is evicted first. Ties are broken by
the order in which leaves entered the eviction heap, which is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable

from control_plane.cache.tree_node import TreeNode

EvictionKey = tuple[int, ...]
EvictionKeyFn = Callable[[TreeNode], EvictionKey]


def lru_key(node: TreeNode) -> EvictionKey:
    return (node.last_access_time,)


def lfu_key(node: TreeNode) -> EvictionKey:
    return (node.hit_count, node.last_access_time)


def fifo_key(node: TreeNode) -> EvictionKey:
    return (node.creation_time,)


def mru_key(node: TreeNode) -> EvictionKey:
    return (-node.last_access_time,)


def filo_key(node: TreeNode) -> EvictionKey:
    return (-node.creation_time,)


def priority_key(node: TreeNode) -> EvictionKey:
    return (node.priority, node.last_access_time)


def slru_key(node: TreeNode) -> EvictionKey:
    # Segmented LRU: nodes hit at least twice sit in the protected segment, evicted after all others.
    return (1 if node.hit_count >= 2 else 0, node.last_access_time)


EVICTION_POLICIES: dict[str, EvictionKeyFn] = {
    "lru": lru_key,
    "lfu": lfu_key,
    "fifo": fifo_key,
    "mru": mru_key,
    "filo": filo_key,
    "priority": priority_key,
    "slru": slru_key,
}


def eviction_key_fn(name: str) -> EvictionKeyFn:
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose from {sorted(EVICTION_POLICIES)}"
        ) from None
