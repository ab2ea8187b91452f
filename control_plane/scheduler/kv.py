"""KV bookkeeping for one worker: slot allocator, prefix tree and request-to-token table.

The control plane's books are authoritative (docs/architecture.md#who-owns-what): it decides which slot each
new token's KV is written to and names it in the plan. This module implements SGLang's cache operations on
those books (docs/scheduler.md#retraction, #caching-requests, #allocation) and reports slot remaps the worker
must follow.

Every slot is in exactly one of four states: free (allocator), evictable or protected (tree,
unlocked or locked), or private to one request (computed by it, or reserved for a decode in flight,
and not in the tree). A request's row holds positions [0, kv_allocated_len); of those, [0,
kv_committed_len) hold KV the tree may take. The rest (the slot of a decode still in flight when the
request ends) is never inserted and goes back to the allocator (SGLang's kv_allocated_len).

The per-row state of requests holding rows lives in `columns` (see control_plane/scheduler/columns.py);
rows are attached to it when taken and detached when released.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from control_plane.cache.allocator import SlotAllocator
from control_plane.cache.radix import RadixCache
from control_plane.cache.tree_node import TreeNode
from control_plane.request import Request
from control_plane.scheduler.columns import RowColumns
from control_plane.scheduler.priority import priority_sign, urgency
from protos.worker import SlotRemap as Remap


class KvOutOfMemory(RuntimeError):
    """An allocation that admission or the decode check should have prevented."""


def eviction_priority(req: Request, low_values_first: bool) -> int:
    """The request's priority as the radix tree keeps it: larger = more important = evicted later.

    The tree's priority policy evicts the smallest (priority, last_access_time) first and a node keeps the
    largest priority inserted through it (docs/scheduler.md#radix-cache, #locks-and-eviction). The
    scheduler ranks requests by `priority_sign`: larger values first by default, smaller ones with
    --schedule-low-priority-values-first, so there the value is negated to keep "more important = kept
    longer" in both modes. (SGLang inserts the raw value, `getattr(req, "priority", 0) or 0` in
    radix_cache.py:cache_finished_req, so its priority eviction keeps the least important requests'
    prefixes longest under low-values-first.) None, a request without a priority while priority scheduling
    is off, counts as 0 as in SGLang; with priority scheduling on, intake has already replaced None by the
    least important value (docs/scheduler.md#intake), which maps to the smallest tree priority.
    """
    return -urgency(req, priority_sign(low_values_first))


class KvManager:
    """Allocator + radix tree + request rows. Mutating calls say so in their docstrings."""

    def __init__(
        self,
        capacity: int,
        page_size: int,
        max_running_requests: int,
        max_context: int,
        *,
        disable_radix_cache: bool = False,
        eviction_policy: str = "lru",
        low_priority_values_first: bool = False,
    ) -> None:
        self.capacity = capacity
        self.page_size = page_size
        # The scheduler's priority convention (--schedule-low-priority-values-first), for
        # `eviction_priority`.
        self.low_priority_values_first = low_priority_values_first
        self.allocator = SlotAllocator(capacity, page_size)
        self.tree = RadixCache(
            self.allocator, page_size=page_size, disable=disable_radix_cache, eviction_policy=eviction_policy
        )
        # One row per admitted request: position -> slot id (SGLang's req_to_token_pool). Grown on
        # demand up to max_running_requests × (max_context + 1), so that construction costs nothing.
        self.req_to_token = np.zeros((0, 0), dtype=np.int64)
        self._table_limit = (max_running_requests, max_context + 1)
        # A min-heap: the lowest free row is taken first, so the table grows with the requests held at
        # once, not with every row ever handed out (a row's number decides nothing else: every decision
        # reads the request, the row only indexes its columns).
        self._free_rows = list(range(max_running_requests))
        self.columns = RowColumns(max_running_requests)

    # --- sizes ---------------------------------------------------------------------------------

    @property
    def disabled(self) -> bool:
        return bool(self.tree.disable)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        return self.tree.protected_size()

    def free_rows(self) -> int:
        return len(self._free_rows)

    def used_tokens(self) -> int:
        """T − (available + evictable): what the log lines call #token
        (docs/scheduler.md#logs-and-metrics)."""
        return self.capacity - (self.available_size() + self.evictable_size())

    def evict_for(self, num_tokens: int) -> None:
        """Mutates: if fewer than num_tokens slots are free, evict num_tokens (not the shortfall)."""
        if self.available_size() < num_tokens:
            self.tree.evict(num_tokens)

    # --- prefix matching -------------------------------------------------------------------------

    def match_prefix(self, req: Request, max_prefix_len: int) -> None:
        """Mutates req (prefix_indices, last_node) and the tree's access clock and splits."""
        if self.disabled:
            req.prefix_indices, req.last_node = np.zeros(0, dtype=np.int64), None
            return
        key = req.fill_ids[:max_prefix_len]
        result = self.tree.match_prefix(key)
        req.prefix_indices, req.last_node = result.indices, result.last_node

    def init_next_round_input(self, req: Request) -> None:
        """Mutates req and the tree like match_prefix: SGLang's req.init_next_round_input, the match
        before an admission attempt (docs/scheduler.md#admission-loop step 9e). A match never covers
        the last token: the prefill must produce logits (docs/scheduler.md#prefill-adder-budgets,
        #invariants), nor a prompt position still to be scored. A request whose KV comes back from
        the host pool matches nothing and locks nothing."""
        req.matched_fill_len = req.seqlen
        if req.host_backup_len:
            req.prefix_indices, req.last_node, req.cache_protected_len = np.zeros(0, dtype=np.int64), None, 0
            return
        longest = max(req.seqlen - 1, 0)
        if req.scores_pending:
            # Prompt positions still to be scored are computed again (SGLang's cap at logprob_start_len,
            # docs/scheduler.md#prompt-log-probabilities).
            longest = min(longest, req.score_received_to)
        self.match_prefix(req, longest)
        req.cache_protected_len = len(req.prefix_indices)

    def inc_lock(self, node: Any) -> None:
        if node is not None and not self.disabled:
            self.tree.inc_lock_ref(node)

    def dec_lock(self, node: Any) -> None:
        if node is not None and not self.disabled:
            self.tree.dec_lock_ref(node)

    # --- allocation ------------------------------------------------------------------------------

    def row(self, req: Request) -> np.ndarray:
        """A view of the request's row; it stops aliasing the table when the table grows."""
        return self.req_to_token[req.req_pool_idx]

    def _reserve(self, rows: int, cols: int) -> None:
        """Mutates: grow req_to_token (by doubling, up to its limit) to at least rows × cols.

        Existing entries are kept; views from `row` taken before a growth no longer alias the table.
        Beyond the limit, indexing fails as it would on a table allocated up front.
        """
        have_rows, have_cols = self.req_to_token.shape
        if rows <= have_rows and cols <= have_cols:
            return
        max_rows, max_cols = self._table_limit
        new_rows = min(max_rows, max(rows, 2 * have_rows)) if rows > have_rows else have_rows
        new_cols = min(max_cols, max(cols, 2 * have_cols, 256)) if cols > have_cols else have_cols
        table = np.zeros((new_rows, new_cols), dtype=np.int64)
        table[:have_rows, :have_cols] = self.req_to_token
        self.req_to_token = table

    def alloc_for_extend(self, reqs: list[Request]) -> list[np.ndarray]:
        """Mutates: request rows and slots for each request's extend_range; returns the new slots.

        A request without a row gets one (attached to `columns`), and its cached prefix is written
        into it first. Afterwards kv_allocated_len is the extend's end.
        """
        self.evict_for(self.extend_need(reqs))
        out = []
        for req in reqs:
            start, end = req.extend_range
            new_row = req.req_pool_idx < 0
            if new_row:
                if not self._free_rows:
                    raise KvOutOfMemory("alloc_req_slots runs out of memory")
                req.req_pool_idx = heapq.heappop(self._free_rows)
                self.columns.attach(req)
            self._reserve(req.req_pool_idx + 1, end)
            row = self.row(req)
            if new_row:
                row[:start] = req.prefix_indices[:start]
            last_slot = int(row[start - 1]) if start > 0 else -1
            slots = self.allocator.alloc_extend(start, last_slot, end - start)
            if slots is None:
                raise KvOutOfMemory(f"Prefill out of memory: {end - start} tokens for {req.rid}")
            row[start:end] = slots
            req.kv_allocated_len = end
            out.append(slots)
        return out

    def extend_need(self, reqs: list[Request]) -> int:
        """Slots to make room for before allocating these extends
        (docs/scheduler.md#locks-and-eviction, #allocation).

        Page 1: the tokens requested (`alloc_token_slots`). Paged: one spare page per request on top,
        SGLang's over-estimate that every request may start a new page (`alloc_paged_token_slots_extend`).
        """
        tokens = sum(r.extend_range[1] - r.extend_range[0] for r in reqs)
        if self.page_size == 1:
            return tokens
        return tokens + len(reqs) * self.page_size

    def decode_need(self, seq_lens: np.ndarray) -> int:
        """Slots the next decode of these sequences needs (a new page only at a page boundary)."""
        if self.page_size == 1:
            return len(seq_lens)
        return self.page_size * int(np.count_nonzero(seq_lens % self.page_size == 0))

    def growth_need(self, seq_lens: np.ndarray, growth: np.ndarray) -> int:
        """Slots these sequences need to grow by `growth` positions each (whole pages: a sequence's
        last page has room for the positions up to its end)."""
        if self.page_size == 1:
            return int(growth.sum())
        p = self.page_size
        pages = -(-(seq_lens + growth) // p) - -(-seq_lens // p)
        return p * int(pages.sum())

    def check_decode_mem(self, seq_lens: np.ndarray) -> bool:
        """Mutates (may evict): whether the next decode of these sequences fits
        (docs/scheduler.md#decode-memory-check)."""
        need = self.decode_need(seq_lens)
        self.evict_for(need)
        return self.available_size() >= need

    def alloc_for_decode(self, rows: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """Mutates (may evict): one slot per sequence for position seq_len, written into its row;
        the rows' allocated length becomes seq_len + 1.

        Evicts first like every allocation (docs/scheduler.md#locks-and-eviction, #allocation): a
        mixed step has no decode check. Paged, the room made is SGLang's over-estimate, a page per
        sequence whether or not it starts one (`alloc_paged_token_slots_decode`); the check stays exact.
        """
        self.evict_for(len(seq_lens) * self.page_size)
        if len(rows):
            self._reserve(int(rows.max()) + 1, int(seq_lens.max()) + 1)
        last_slots = self.req_to_token[rows, seq_lens - 1]
        slots = self.allocator.alloc_decode_batch(seq_lens, last_slots)
        if slots is None:
            raise KvOutOfMemory("Decode out of memory")
        self.req_to_token[rows, seq_lens] = slots
        self.columns.allocate_decode(rows, seq_lens)
        return slots

    # --- caching and release (docs/scheduler.md#caching-requests, #retraction)
    # -------------------------------------- The cache rules themselves are RadixCache's (one implementation);
    # these adapt a Request and its row to them and keep what is KvManager's own: the row table and the
    # worker's remaps.

    def cache_finished_req(self, req: Request, insert: bool = True) -> None:
        """Mutates: docs/scheduler.md#caching-requests through the tree (insert or free the committed
        KV, drop the request's lock), free the slots allocated past it (a decode in flight: whole
        pages past the committed part's),
        then free the request's row. Afterwards the request holds no slot and no lock."""
        kv_len = req.kv_committed_len
        held = max(req.kv_allocated_len, kv_len)
        self.tree.cache_finished_req(
            req.fill_ids[:kv_len],
            self.row(req)[:held].copy(),
            req.cache_protected_len,
            self._lock_node(req),
            insert=insert,
            priority=eviction_priority(req, self.low_priority_values_first),
        )
        self._release_row(req)

    def cache_unfinished_req(self, req: Request, chunked: bool = False) -> Remap | None:
        """Mutates: docs/scheduler.md#caching-requests through the tree (insert the computed part,
        move the request's lock forward), then write the tree's slots into the request's row.

        Afterwards `prefix_indices` = tree part + the unaligned private tail, `cache_protected_len`
        = the tree part. Returns a remap when the tree already held part of what the request
        computed (its duplicate slots are freed; the worker must read the tree's copies instead).
        """
        kv_len = req.kv_committed_len
        row = self.row(req)
        old_protected = req.cache_protected_len
        state = self.tree.cache_unfinished_req(
            req.fill_ids[:kv_len],
            row[:kv_len].copy(),
            old_protected,
            self._lock_node(req),
            chunked=chunked,
            priority=eviction_priority(req, self.low_priority_values_first),
        )
        row[old_protected : state.protected_len] = state.slots[old_protected : state.protected_len]
        req.prefix_indices = state.slots
        req.cache_protected_len = state.protected_len
        req.last_node = state.last_node
        if state.shared_len <= old_protected:
            return None
        return Remap(req.handle, old_protected, state.slots[old_protected : state.shared_len].copy())

    # --- KV that moves between workers (docs/migration.md) --------------------------------------

    def cached_slots(self, tokens: np.ndarray) -> np.ndarray:
        """Mutates the tree's access clock and splits, like any match: the slots of the longest
        cached prefix of `tokens` (page-aligned; none when the cache is disabled)."""
        if self.disabled:
            return np.zeros(0, dtype=np.int64)
        return self.tree.match_prefix(tokens).indices

    def import_prefix(self, tokens: np.ndarray, start: int = 0) -> tuple[int, np.ndarray] | None:
        """Mutates: a place in the tree for KV another worker sends of positions [start, n) of
        `tokens` (n: the page-aligned length). The leading tokens the tree holds already stay as
        they are (their count is returned); fresh slots for the rest are inserted at once and
        returned, for the next plan's receive to write before any forward reads them. None, with
        nothing inserted, when the cache is disabled, when the tree lacks some of [0, start) (the
        transfer cannot fill that gap), or when the pool has no room even after evicting."""
        if self.disabled:
            return None
        n = len(tokens) - len(tokens) % self.page_size
        match = self.tree.match_prefix(tokens[:n])
        skip = len(match.indices)
        if skip < min(start, n):
            return None
        # The match is locked while room is made, so eviction cannot take what `skip` counts on.
        self.inc_lock(match.last_node)
        try:
            self.evict_for(n - skip)
            fresh = self.allocator.alloc(n - skip) if n > skip else np.zeros(0, dtype=np.int64)
        finally:
            self.dec_lock(match.last_node)
        if fresh is None:
            return None
        cached = self.tree.insert(tokens[:n], np.concatenate((match.indices, fresh)))
        assert cached == skip, f"import: the tree held {cached} tokens, the locked match {skip}"
        return skip, fresh

    def release_req(self, req: Request, remaining: int, retract_decode_steps: int) -> None:
        """Mutates: release a retracted or preempted request without inserting its KV
        (docs/scheduler.md#retraction)."""
        self.cache_finished_req(req, insert=False)
        self.evict_for(remaining * retract_decode_steps)

    def release_gain(self, req: Request, keep: Any = None) -> int:
        """What releasing `req` (release_req) would add to available + evictable: the pages past its
        tree part, and the tree nodes that only its lock holds. Nodes on `keep`'s path (a newcomer's
        match, which its admission locks again) are left out. Reads only."""
        if req.req_pool_idx < 0:
            return 0
        # Slots go back a page at a time: the last page, partly used, frees whole.
        held = -(-max(req.kv_allocated_len, req.kv_committed_len) // self.page_size) * self.page_size
        private = held - req.cache_protected_len
        return max(private, 0) + self._path_tokens(req.last_node, 1, self._path(keep))

    def lock_cost(self, node: Any) -> int:
        """What locking `node` would take from evictable: its path's tokens no lock holds yet. Reads only."""
        return self._path_tokens(node, 0, set())

    def _path(self, node: Any) -> set[int]:
        """The ids of `node` and its ancestors."""
        ids: set[int] = set()
        while node is not None:
            ids.add(id(node))
            node = node.parent
        return ids

    def _path_tokens(self, node: Any, locks: int, skip: set[int]) -> int:
        """Tokens of the nodes from `node` up that hold exactly `locks` locks (a lower segment of the
        path: an ancestor holds at least its children's locks), leaving out the ids in `skip`; 0 for
        an evicted node (its ancestors are out of reach) and when the cache is disabled."""
        if node is None or self.disabled or (node.parent is None and node is not self.tree.root):
            return 0
        tokens = 0
        while node is not self.tree.root and node.lock_ref == locks:
            if id(node) not in skip:
                tokens += len(node.value)
            node = node.parent
        return tokens

    def release_aborted(self, req: Request) -> None:
        """Mutates: free an aborted request's KV (nothing inserted; its lock released)."""
        if req.req_pool_idx >= 0:
            self.cache_finished_req(req, insert=False)
        else:
            self.dec_lock(req.last_node)

    def _lock_node(self, req: Request) -> TreeNode:
        """The node the request holds its lock on; the root (no lock) when it has none."""
        return req.last_node if req.last_node is not None else self.tree.root

    def _release_row(self, req: Request) -> None:
        if req.req_pool_idx >= 0:
            self.columns.detach(req)
            heapq.heappush(self._free_rows, req.req_pool_idx)
            req.req_pool_idx = -1
