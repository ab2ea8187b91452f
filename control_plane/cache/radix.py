"""The radix prefix cache of the control plane (docs/scheduler.md#radix-cache).

Token ids map to the KV slots that hold their KV on the worker. Nodes own whole pages: every key and
value is page-aligned, and a node's value is a run of whole pages as handed out by `SlotAllocator`.

Mutation and locking contract:
* `match_prefix` and `insert` mutate the tree's shape (they may split a node) and its access times, but
  never free or allocate. A `MatchResult` is only safe to use until the next `evict`/`reset` unless its
  `last_node` is locked with `inc_lock_ref`.
* `evict`, `reset`, `cache_finished_req` and `cache_unfinished_req` free slots through the allocator.
  The last two are SGLang's per-request operations (docs/scheduler.md#caching-requests) on plain
  request state; they are the only implementation: the scheduler's KvManager calls them with a
  request's fill ids and row.
* Locked nodes (and all their ancestors) are never evicted. Each admitted request holds exactly one lock,
  on its `last_node`, from admission until finish or retraction (docs/scheduler.md#locks-and-eviction,
  #invariants).

Eviction keeps the evictable leaves in a heap with lazy invalidation instead of scanning all leaves
(docs/scheduler.md#locks-and-eviction asks for an ordered structure): a node's heap entry is current while
`node.heap_entry is entry`; an entry whose key has grown since it was pushed is re-pushed when popped, and a
touch that lowers a key (mru/filo-style policies) pushes a fresh entry at once. So every current entry's key
is ≤ the node's true key, which makes the first popped current entry with an up-to-date key the true minimum.
Stale entries are dropped when popped, and the heap is rebuilt when they outnumber the live ones.
"""

from __future__ import annotations

import heapq
import sys
from array import array
from collections.abc import Hashable, Iterator, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from control_plane.cache.allocator import EMPTY_SLOTS, SLOT_DTYPE, SlotAllocator
from control_plane.cache.evict_policy import eviction_key_fn
from control_plane.cache.tree_node import HeapEntry, TreeNode

# Token ids as callers hold them; array('q') and int64 numpy arrays convert without a Python loop.
TokenIds = Sequence[int] | np.ndarray | array
TOKEN_BYTES = 8  # node keys and queries are int64 token ids as bytes; offsets below are in bytes

# Rebuild the heap once stale entries outnumber live ones by this margin (amortised O(1) per push).
_HEAP_SLACK = 64


class MatchResult(NamedTuple):
    indices: np.ndarray  # KV slots of the matched, page-aligned prefix
    last_node: TreeNode  # deepest matched node (the root when nothing matched); lock it to keep `indices`


class TreeListener(Protocol):
    """Told of every change to the tree's shape, right after it is made (the waiting queue's kept
    matches, control_plane/scheduler/queue_matches.py). Access times and locks are not shape."""

    def on_split(self, lower: TreeNode) -> None:
        """`lower` now hangs under a new node that holds the first part of its old key."""

    def on_new_child(self, parent: TreeNode, edge: Hashable) -> None:
        """A new leaf hangs under `parent` at `edge`."""

    def on_removed(self, leaf: TreeNode) -> None:
        """`leaf` was evicted."""

    def on_reset(self) -> None:
        """Every node was dropped."""


class PeekResult(NamedTuple):
    tokens: int  # page-aligned tokens matched
    node: TreeNode  # the node the match ends in (the root when nothing matched)
    whole: bool  # the match covers all of `node`'s key (always for the root)


class ReqCacheState(NamedTuple):
    """What a request holds in the cache after `cache_finished_req` / `cache_unfinished_req`."""

    slots: np.ndarray  # the request's slots for its positions [0, len(slots))
    last_node: TreeNode  # the node the request holds its one lock on (the root: no lock)
    protected_len: int  # positions [0, protected_len) are tree-owned: the request must never free them
    # Positions [0, shared_len) were in the tree before the call: the request's own slots for those
    # past its old protected_len were duplicates, now freed and replaced by the tree's (a remap).
    shared_len: int = 0


def as_token_bytes(key: TokenIds) -> bytes:
    """Token ids as native int64 bytes, the tree's key format: `bytes.startswith(node_key, offset)`
    compares a node without slicing the query, and pages hash as dict keys. One memcpy for numpy
    arrays and array('q'); a Python loop for lists (prefer the former on hot paths)."""
    if isinstance(key, np.ndarray):
        return key.astype(np.int64, copy=False).tobytes()
    if isinstance(key, array) and key.typecode == "q":
        return key.tobytes()
    return array("q", key).tobytes()


class RadixCache:
    """Radix tree from token ids to KV slots, with page size ≥ 1, locks and pluggable eviction.

    `allocator` may be None for a simulated tree (docs/scheduler.md#in-batch-prefix-dedup's in-batch
    prefix dedup): then values default to the token ids themselves and nothing is ever freed.
    `disable=True` is the `--disable-radix-cache` behaviour: matches are empty, nothing is stored,
    evictable size is 0, and finishing a request frees all of its slots (docs/scheduler.md#radix-cache's
    ChunkCache).
    """

    def __init__(
        self,
        allocator: SlotAllocator | None,
        page_size: int = 1,
        disable: bool = False,
        eviction_policy: str = "lru",
    ) -> None:
        if allocator is not None and allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} differs from the allocator's {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.eviction_policy = eviction_policy
        self._page_bytes = page_size * TOKEN_BYTES
        self._eviction_key = eviction_key_fn(eviction_policy)
        self._clock = 0
        # At most one; None costs a test per shape change.
        self.listener: TreeListener | None = None
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode(b"", EMPTY_SLOTS, None, self._clock, priority=-sys.maxsize)
        self.root.lock_ref = 1  # the root is never evicted (docs/scheduler.md#radix-cache)
        self._evictable_size = 0
        self._protected_size = 0
        self._heap: list[HeapEntry] = []
        self._heap_seq = 0
        self._live_leaves = 0

    # ---- sizes ---------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (freeable by `evict`)."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    # ---- lookup and insertion ------------------------------------------------------------------

    def match_prefix(self, key: TokenIds, extra_key: Hashable = None) -> MatchResult:
        """Longest cached page-aligned prefix of `key` (docs/scheduler.md#radix-cache). Mutates:
        splits a node where the match
        ends inside it, and stamps the path's access time."""
        if self.disable:
            return MatchResult(EMPTY_SLOTS, self.root)
        return self._match(as_token_bytes(key), extra_key)

    def _match(self, tokens: bytes, extra_key: Hashable) -> MatchResult:
        step = self._page_bytes
        end = len(tokens) - len(tokens) % step
        now = self._tick()
        node = self.root
        node.last_access_time = now
        values: list[np.ndarray] = []
        at = 0
        edge = self._edge(tokens, 0, extra_key) if end else None
        # The hot loop of admission (docs/performance.md: a few µs per 2k-token match): a node that matches
        # whole costs one dict lookup and one memcmp, with no copy of the query.
        while at < end:
            child = node.children.get(edge)
            if child is None:
                break
            child.last_access_time = now
            child_key = child.key
            size = len(child_key)
            if at + size <= end and tokens.startswith(child_key, at):
                matched = size
            else:
                matched = self._match_len(child_key, tokens, at, end)
            if matched < size:  # the match ends inside `child`
                self._on_touch(child)  # the lower part keeps the new access time, as in SGLang
                node = self._split(child, matched, edge)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            at += size
            if at < end:
                edge = tokens[at : at + step]
        self._on_touch(node)
        return MatchResult(_concat(values), node)

    def cached_len(self, tokens: bytes, extra_key: Hashable = None) -> int:
        """Tokens of the longest cached page-aligned prefix of `tokens` (as_token_bytes), touching
        nothing: no split, no access time. The router asks every worker's tree this; only the chosen
        worker's scheduler then matches for real, so routing leaves no trace a replay would miss."""
        if self.disable:
            return 0
        return self.peek(tokens, extra_key).tokens

    def peek(self, tokens: bytes, extra_key: Hashable = None) -> PeekResult:
        """`match_prefix` without its side effects (no split, no access time): how many tokens
        match and which node the match ends in, possibly part way."""
        step = self._page_bytes
        end = len(tokens) - len(tokens) % step
        node, at, whole = self.root, 0, True
        edge = self._edge(tokens, 0, extra_key) if end else None
        while at < end:
            child = node.children.get(edge)
            if child is None:
                break
            child_key = child.key
            size = len(child_key)
            if at + size <= end and tokens.startswith(child_key, at):
                matched = size
            else:
                matched = self._match_len(child_key, tokens, at, end)
            at += matched
            if matched < size:
                if matched:
                    node, whole = child, False
                break
            node = child
            if at < end:
                edge = tokens[at : at + step]
        return PeekResult(at // TOKEN_BYTES, node, whole)

    def edge_at(self, tokens: bytes, at_token: int) -> Hashable | None:
        """The child key a match of `tokens` (with no extra key) follows after `at_token` tokens;
        None when less than a page is left."""
        at = at_token * TOKEN_BYTES
        end = len(tokens) - len(tokens) % self._page_bytes
        return tokens[at : at + self._page_bytes] if at < end else None

    def insert(
        self,
        key: TokenIds,
        value: np.ndarray | None = None,
        priority: int = 0,
        chunked: bool = False,
        extra_key: Hashable = None,
    ) -> int:
        """Store `key` → `value` (page-aligned; docs/scheduler.md#radix-cache) and return how many
        leading tokens were already cached. Mutates the tree; the caller still owns `value[:returned]`
        (duplicates to free) and whatever lies past the page-aligned length. Does not lock anything. A
        disabled cache stores
        nothing and returns 0: release requests through `cache_finished_req` there."""
        if self.disable:
            return 0
        tokens = as_token_bytes(key)
        return self._insert(tokens, self._value_for(tokens, value), priority, chunked, extra_key)

    def _insert(
        self, tokens: bytes, slots: np.ndarray, priority: int, chunked: bool, extra_key: Hashable
    ) -> int:
        step = self._page_bytes
        end = len(tokens) - len(tokens) % step
        now = self._tick()
        node = self.root
        node.last_access_time = now
        at = 0
        edge = self._edge(tokens, 0, extra_key) if end else None
        while at < end:
            child = node.children.get(edge)
            if child is None:
                break
            child.last_access_time = now
            if priority > child.priority:
                # A node keeps the highest priority that used it (docs/scheduler.md#radix-cache).
                child.priority = priority
            if not chunked:  # middle chunks are not hits (docs/scheduler.md#radix-cache)
                child.hit_count += 1
            size = len(child.key)
            if at + size <= end and tokens.startswith(child.key, at):
                matched = size
            else:
                matched = self._match_len(child.key, tokens, at, end)
                self._on_touch(child)  # the lower part keeps the new time, hits and priority
                child = self._split(child, matched, edge)
            node = child
            at += matched
            if at < end:
                edge = tokens[at : at + step]
        if at < end:
            new_slots = slots[at // TOKEN_BYTES : end // TOKEN_BYTES].copy()
            self._add_leaf(node, edge, tokens[at:end], new_slots, priority, extra_key)
        else:
            self._on_touch(node)
        return at // TOKEN_BYTES

    # ---- locks ---------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock `node` and its ancestors (docs/scheduler.md#locks-and-eviction). Mutates lock counts
        and sizes; returns the change in
        evictable size (≤ 0). `node` must not have been evicted."""
        if self.disable:
            return 0
        if node.parent is None and node is not self.root:
            raise ValueError("inc_lock_ref on an evicted node; lock a match before evicting")
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                delta -= self._move_size(node, locking=True)
            node.lock_ref += 1
            if node.lock_ref == 1:
                self._refresh_leaf(node)
            node = node.parent  # type: ignore[assignment]
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release one lock taken by `inc_lock_ref(node)`. Mutates; returns the change in evictable
        size (≥ 0)."""
        if self.disable or node is self.root:
            return 0
        if node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref on unlocked {node!r}")
        delta = 0
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += self._move_size(node, locking=False)
                self._refresh_leaf(node)
            node = node.parent  # type: ignore[assignment]
        return delta

    # ---- eviction ------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free whole unlocked leaves, cheapest first by the policy, until ≥ `num_tokens` tokens are
        freed or nothing is evictable (docs/scheduler.md#locks-and-eviction). Mutates the tree and the
        allocator; returns tokens freed (may overshoot). Costs O(k log n) for k evicted nodes,
        amortised: an entry made stale by an
        access is re-pushed once, paid for by that access."""
        if self.disable:
            return 0
        victims: list[np.ndarray] = []
        freed = 0
        while freed < num_tokens:
            leaf = self._pop_evictable()
            if leaf is None:
                break
            victims.append(leaf.value)
            freed += len(leaf.value)
            self._delete_leaf(leaf)
        if victims and self.allocator is not None:
            self.allocator.free(np.concatenate(victims))
        return freed

    def reset(self) -> None:
        """Drop every node and free its slots (a cache flush). Mutates; only allowed while nothing is
        locked, i.e. when no request is admitted."""
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} locked tokens; flush only when idle")
        values = [node.value for node in self.iter_nodes() if node is not self.root]
        if values and self.allocator is not None:
            self.allocator.free(np.concatenate(values))
        self._init_tree()
        if self.listener is not None:
            self.listener.on_reset()

    # ---- per-request helpers (docs/scheduler.md#caching-requests)
    # ------------------------------------------------------

    def cache_finished_req(
        self,
        tokens: TokenIds,
        slots: np.ndarray,
        protected_len: int,
        last_node: TreeNode,
        insert: bool = True,
        priority: int = 0,
        extra_key: Hashable = None,
    ) -> ReqCacheState:
        """Hand a finished (or retracted, `insert=False`) request's KV to the tree and release it
        (docs/scheduler.md#caching-requests).

        `tokens` are the ids of the positions whose KV is committed (kv_len = len(tokens)); `slots` are
        all slots the request holds, positions [0, len(slots)) with len(slots) ≥ kv_len (anything past
        kv_len is over-allocation). Mutates: inserts the page-aligned part when `insert`, frees every
        slot the tree does not keep (duplicates of cached pages, the unaligned tail, over-allocation),
        and drops the request's lock on `last_node`. The caller frees nothing afterwards; the returned
        state is the empty one (no slots, the root, 0).
        """
        slots = np.asarray(slots, dtype=SLOT_DTYPE)
        if self.disable:
            self._free(slots[protected_len:])
            return self.empty_state()
        key = as_token_bytes(tokens)
        aligned = self._aligned_req_len(key, slots, protected_len)
        if insert:
            cached = self._insert(key[: aligned * TOKEN_BYTES], slots[:aligned], priority, False, extra_key)
            self._free(slots[protected_len:cached])
        else:
            self._free(slots[protected_len:aligned])
        self._free(slots[aligned:])
        self.dec_lock_ref(last_node)
        return self.empty_state()

    def cache_unfinished_req(
        self,
        tokens: TokenIds,
        slots: np.ndarray,
        protected_len: int,
        last_node: TreeNode,
        chunked: bool = False,
        priority: int = 0,
        extra_key: Hashable = None,
    ) -> ReqCacheState:
        """Share a still-running request's computed prefix through the tree
        (docs/scheduler.md#caching-requests).

        `tokens` are the ids of positions [0, n) computed so far (fill_ids[:extend_end]); `slots` hold
        positions [0, len(slots)) with len(slots) ≥ n. Mutates: inserts the page-aligned part, frees the
        request's duplicates of pages that were already cached, and moves the request's lock from
        `last_node` to the new deepest node. Returns the request's new slots (tree slots for the aligned
        prefix, its own for the rest), lock node and protected length; the unaligned tail stays private.
        `shared_len` tells which positions now read the tree's slots instead of the request's own (the
        caller's remap). Use `chunked=True` for middle chunks (no hit counting).
        """
        slots = np.asarray(slots, dtype=SLOT_DTYPE)
        if self.disable:
            return ReqCacheState(slots, last_node, protected_len)
        key = as_token_bytes(tokens)
        aligned = self._aligned_req_len(key, slots, protected_len)
        key = key[: aligned * TOKEN_BYTES]
        cached = self._insert(key, slots[:aligned], priority, chunked, extra_key)
        self._free(slots[protected_len:cached])
        match = self._match(key, extra_key)  # the tree's own slots now back every aligned position
        new_slots = np.concatenate((match.indices, slots[len(match.indices) :]))
        self.dec_lock_ref(last_node)
        self.inc_lock_ref(match.last_node)
        return ReqCacheState(new_slots, match.last_node, len(match.indices), cached)

    def empty_state(self) -> ReqCacheState:
        """The state of a request that holds nothing (new, finished or retracted)."""
        return ReqCacheState(EMPTY_SLOTS, self.root, 0)

    # ---- inspection ----------------------------------------------------------------------------

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node, root first, depth-first in child insertion order."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def eviction_key(self, node: TreeNode) -> tuple[int, ...]:
        return self._eviction_key(node)

    def heap_entries(self) -> list[HeapEntry]:
        """The raw eviction heap, stale entries included (for invariant checks)."""
        return list(self._heap)

    def live_leaf_count(self) -> int:
        return self._live_leaves

    # ---- internals: tree shape -----------------------------------------------------------------

    def _tick(self) -> int:
        # A logical clock, not time.monotonic(): eviction order must replay identically
        # (docs/scheduler.md#radix-cache uses it only for ordering).
        self._clock += 1
        return self._clock

    def _edge(self, tokens: bytes, at: int, extra_key: Hashable = None) -> Hashable:
        """Child-dict key of the run starting at byte `at`: its first page; namespaced by `extra_key` at
        the root only, since a namespace is fixed by a node's first edge (docs/scheduler.md#radix-cache)."""
        page = tokens[at : at + self._page_bytes]
        return page if extra_key is None else (extra_key, page)

    def _edge_of(self, node: TreeNode) -> Hashable:
        extra = node.extra_key if node.parent is self.root else None
        return self._edge(node.key, 0, extra)

    def _match_len(self, node_key: bytes, tokens: bytes, at: int, end: int) -> int:
        """Bytes in common between `node_key` and tokens[at:end], rounded down to whole pages."""
        limit = min(len(node_key), end - at)
        if tokens.startswith(node_key[:limit], at):
            return limit
        count = limit // TOKEN_BYTES
        mine = np.frombuffer(node_key, dtype=np.int64, count=count)
        theirs = np.frombuffer(tokens, dtype=np.int64, count=count, offset=at)
        first_diff = int(np.argmax(mine != theirs))
        return (first_diff - first_diff % self.page_size) * TOKEN_BYTES

    def _split(self, child: TreeNode, length: int, edge: Hashable) -> TreeNode:
        """Cut `child` after `length` bytes; the new upper node takes the child's place, locks, hit count
        and priority (docs/scheduler.md#radix-cache). The lower part keeps its times, so its heap
        entry stays valid."""
        parent = child.parent
        cut = length // TOKEN_BYTES
        upper = TreeNode(child.key[:length], child.value[:cut], parent, self._clock, child.priority)
        upper.extra_key = child.extra_key
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        child.key = child.key[length:]
        child.value = child.value[cut:]
        child.parent = upper
        upper.children[self._edge(child.key, 0)] = child
        parent.children[edge] = upper  # type: ignore[union-attr]
        if self.listener is not None:
            self.listener.on_split(child)
        return upper

    def _add_leaf(
        self, parent: TreeNode, edge: Hashable, key: bytes, value: np.ndarray, priority: int, extra: Hashable
    ) -> None:
        value.flags.writeable = False  # match results hand out views of node values
        leaf = TreeNode(key, value, parent, self._clock, priority, extra)
        parent.children[edge] = leaf
        self._evictable_size += len(value)
        self._refresh_leaf(parent)
        self._refresh_leaf(leaf)
        if self.listener is not None:
            self.listener.on_new_child(parent, edge)

    def _delete_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._edge_of(leaf)]
        self._evictable_size -= len(leaf.value)
        leaf.parent = None  # marks it evicted: inc_lock_ref refuses it
        self._refresh_leaf(parent)
        if self.listener is not None:
            self.listener.on_removed(leaf)

    def _move_size(self, node: TreeNode, locking: bool) -> int:
        size = len(node.value)
        sign = 1 if locking else -1
        self._evictable_size -= sign * size
        self._protected_size += sign * size
        return size

    # ---- internals: the eviction heap ----------------------------------------------------------

    def _refresh_leaf(self, node: TreeNode) -> None:
        """Keep `node.heap_entry` set exactly while it is an evictable leaf (root's lock_ref is 1)."""
        evictable = node.lock_ref == 0 and not node.children
        if evictable and node.heap_entry is None:
            self._push(node)
        elif not evictable and node.heap_entry is not None:
            node.heap_entry = None
            self._live_leaves -= 1

    def _on_touch(self, node: TreeNode) -> None:
        """After an access changed `node`'s key: re-push at once only if the key went down."""
        entry = node.heap_entry
        if entry is not None and self._eviction_key(node) < entry[:-2]:
            self._push(node)

    def _push(self, node: TreeNode) -> None:
        if node.heap_entry is None:
            self._live_leaves += 1
        entry: HeapEntry = (*self._eviction_key(node), self._heap_seq, node)
        self._heap_seq += 1
        node.heap_entry = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * self._live_leaves + _HEAP_SLACK:
            self._heap = [e for e in self._heap if e[-1].heap_entry is e]
            heapq.heapify(self._heap)

    def _pop_evictable(self) -> TreeNode | None:
        while self._heap:
            entry = heapq.heappop(self._heap)
            node: TreeNode = entry[-1]
            if node.heap_entry is not entry:
                continue  # stale: the node was locked, got a child, or was re-pushed
            node.heap_entry = None
            self._live_leaves -= 1
            if self._eviction_key(node) != entry[:-2]:
                self._push(node)  # accessed since it was pushed: requeue at its true key
                continue
            return node
        return None

    # ---- internals: requests -------------------------------------------------------------------

    def _value_for(self, tokens: bytes, value: np.ndarray | None) -> np.ndarray:
        if value is None:  # simulated tree: the token ids stand in for slots
            return np.frombuffer(tokens, dtype=np.int64)
        value = np.asarray(value, dtype=SLOT_DTYPE)
        if len(value) * TOKEN_BYTES != len(tokens):
            raise ValueError(f"insert: {len(tokens) // TOKEN_BYTES} tokens but {len(value)} slots")
        return value

    def _aligned_req_len(self, key: bytes, slots: np.ndarray, protected_len: int) -> int:
        """The request's page-aligned token count, after checking its state is coherent."""
        num_tokens = len(key) // TOKEN_BYTES
        aligned = num_tokens - num_tokens % self.page_size
        if len(slots) < num_tokens or protected_len > aligned or protected_len % self.page_size:
            raise ValueError(
                f"request state: {num_tokens} tokens, {len(slots)} slots, protected_len {protected_len}"
            )
        return aligned

    def _free(self, slots: np.ndarray) -> None:
        if self.allocator is not None:
            self.allocator.free(slots)


def _concat(values: list[np.ndarray]) -> np.ndarray:
    if not values:
        return EMPTY_SLOTS
    return values[0] if len(values) == 1 else np.concatenate(values)
