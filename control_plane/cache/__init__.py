"""KV-slot bookkeeping of the control plane: slot allocator, radix prefix cache, pool invariants."""

from control_plane.cache.allocator import SlotAllocator
from control_plane.cache.invariants import InvariantError, PoolCheck, check_pool_invariants
from control_plane.cache.radix import MatchResult, RadixCache, ReqCacheState
from control_plane.cache.tree_node import TreeNode

__all__ = [
    "InvariantError",
    "MatchResult",
    "PoolCheck",
    "RadixCache",
    "ReqCacheState",
    "SlotAllocator",
    "TreeNode",
    "check_pool_invariants",
]
