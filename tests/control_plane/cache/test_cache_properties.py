"""Random traces of a scheduler's cache calls: invariants hold after every operation
(docs/scheduler.md#data-model),
no slot is ever held twice, and everything returns to the free list once all locks are released."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from control_plane.cache.invariants import check_pool_invariants
from control_plane.cache.radix import RadixCache
from control_plane.cache.tree_node import TreeNode
from tests.control_plane.cache.helpers import FakeReq, admit, decode, insert_fresh, make_cache

# A tiny vocabulary makes prompts share prefixes, split nodes and collide often.
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=14)
POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]


def path_slots(tree: RadixCache, node: TreeNode) -> list[int]:
    """The slots from the root down to `node` (read-only, unlike a match)."""
    parts = []
    while node is not tree.root:
        parts.append(node.value.tolist())
        assert node.parent is not None, "a request holds an evicted node"
        node = node.parent
    return [slot for part in reversed(parts) for slot in part]


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    capacity = 48

    def __init__(self) -> None:
        super().__init__()
        self.reqs: list[FakeReq] = []
        self.computed: list[int] = []  # per request: positions with KV; the rest of its prompt is pending

    @initialize(policy=st.sampled_from(POLICIES), disable=st.sampled_from([False, False, False, True]))
    def setup(self, policy: str, disable: bool) -> None:
        self.alloc, self.tree = make_cache(self.capacity, self.page_size, policy, disable)

    # ---- rules ---------------------------------------------------------------------------------

    @rule(tokens=tokens_st, chunk=st.integers(1, 14), priority=st.integers(-2, 3))
    def admit_request(self, tokens: list[int], chunk: int, priority: int) -> None:
        match_len = len(self.tree.match_prefix(tokens[:-1]).indices)
        req = admit(self.alloc, self.tree, tokens, extend=min(chunk, len(tokens) - match_len))
        if req is not None:
            req.priority = priority
            self.reqs.append(req)
            self.computed.append(len(req.slots))

    @precondition(lambda self: any(c < len(r.tokens) for r, c in zip(self.reqs, self.computed, strict=True)))
    @rule(data=st.data(), chunk=st.integers(1, 14))
    def next_chunk(self, data: st.DataObject, chunk: int) -> None:
        """Cache the chunk done so far (docs/scheduler.md#caching-requests, chunked=True), then
        allocate the next one."""
        pending = [i for i, r in enumerate(self.reqs) if self.computed[i] < len(r.tokens)]
        i = data.draw(st.sampled_from(pending))
        req, done = self.reqs[i], self.computed[i]
        self._cache_unfinished(req, req.tokens[:done], chunked=True)
        extend = min(chunk, len(req.tokens) - done)
        new = self.alloc.alloc_extend(done, int(req.slots[-1]), extend)
        if new is None:
            self.tree.evict(extend + self.page_size)
            new = self.alloc.alloc_extend(done, int(req.slots[-1]), extend)
        if new is not None:
            self._assert_fresh(new)
            req.slots = np.concatenate((req.slots, new))
            self.computed[i] = len(req.slots)

    @precondition(lambda self: self._prefilled())
    @rule(data=st.data())
    def prefill_done(self, data: st.DataObject) -> None:
        """After the last prefill chunk of a request that goes on decoding
        (docs/scheduler.md#caching-requests, chunked=False)."""
        req = self.reqs[data.draw(st.sampled_from(self._prefilled()))]
        self._cache_unfinished(req, req.tokens, chunked=False)

    @precondition(lambda self: self._prefilled())
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode_step(self, data: st.DataObject, token: int) -> None:
        i = data.draw(st.sampled_from(self._prefilled()))
        req = self.reqs[i]
        held = self._held_slots()
        if not decode(self.alloc, req, token):
            self.tree.evict(self.page_size)
            held = self._held_slots()
            decode(self.alloc, req, token)
        if len(req.slots) > self.computed[i]:
            assert int(req.slots[-1]) not in held, "a slot was handed out twice"
            self.computed[i] = len(req.slots)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), insert=st.booleans(), drop_last=st.booleans())
    def finish(self, data: st.DataObject, insert: bool, drop_last: bool) -> None:
        """Finish (insert) or retract (no insert); `drop_last` models a reserved, uncommitted slot."""
        i = data.draw(st.integers(0, len(self.reqs) - 1))
        self._release(i, insert, drop_last)

    @precondition(lambda self: not self.tree.disable)  # a disabled tree takes nothing: callers never insert
    @rule(tokens=tokens_st)
    def insert_computed(self, tokens: list[int]) -> None:
        if self.alloc.available_size() >= len(tokens) + self.page_size:
            insert_fresh(self.alloc, self.tree, tokens)

    @rule(tokens=tokens_st)
    def match(self, tokens: list[int]) -> None:
        self.tree.match_prefix(tokens)

    @rule(num_tokens=st.integers(0, 20))
    def evict(self, num_tokens: int) -> None:
        evictable, available = self.tree.evictable_size(), self.alloc.available_size()
        freed = self.tree.evict(num_tokens)
        assert freed >= min(num_tokens, evictable) or freed == evictable
        assert self.alloc.available_size() == available + freed

    # ---- checks --------------------------------------------------------------------------------

    @invariant()
    def pool_adds_up(self) -> None:
        if hasattr(self, "tree"):
            private = sum(r.private_slots(self.page_size) for r in self.reqs)
            check_pool_invariants(self.alloc, self.tree, private)

    @invariant()
    def requests_hold_disjoint_pages(self) -> None:
        if not hasattr(self, "tree"):
            return
        seen: set[int] = set()
        for req in self.reqs:
            if not self.tree.disable:
                assert path_slots(self.tree, req.last_node) == req.slots[: req.protected_len].tolist()
            pages = set((req.slots[req.protected_len :] // self.page_size).tolist())
            assert not pages & seen, "two requests share a private page"
            assert not self.alloc.is_free(req.slots).any(), "a request holds a free slot"
            seen |= pages
        tree_pages = {s // self.page_size for s in self._tree_slots()}
        assert not tree_pages & seen, "a private page is also in the tree"

    @invariant()
    def priority_never_grows_downwards(self) -> None:
        """docs/scheduler.md#radix-cache: an insert raises every node on its path to max(existing,
        new), and a split copies the
        node's priority to the new upper part, so no node outranks its (non-root) parent."""
        if not hasattr(self, "tree"):
            return
        for node in self.tree.iter_nodes():
            if node is not self.tree.root:
                assert all(child.priority <= node.priority for child in node.children.values())

    def teardown(self) -> None:
        if not hasattr(self, "tree"):
            return
        while self.reqs:
            self._release(len(self.reqs) - 1, insert=True, drop_last=False)
        assert self.tree.protected_size() == 0
        self.tree.evict(self.capacity)
        assert self.tree.total_size() == 0
        assert self.alloc.available_size() == self.capacity
        check_pool_invariants(self.alloc, self.tree, 0)

    # ---- helpers -------------------------------------------------------------------------------

    def _prefilled(self) -> list[int]:
        return [i for i, r in enumerate(self.reqs) if self.computed[i] >= len(r.tokens)]

    def _cache_unfinished(self, req: FakeReq, tokens: list[int], chunked: bool) -> None:
        own, old_protected = req.slots.copy(), req.protected_len
        state = self.tree.cache_unfinished_req(
            tokens, req.slots, req.protected_len, req.last_node, chunked, req.priority
        )
        # The shared positions read the tree's slots and the request's duplicates went back to the
        # allocator; every later position keeps the request's own slot (docs/scheduler.md#caching-requests).
        assert self.tree.disable or old_protected <= state.shared_len <= state.protected_len
        assert self.alloc.is_free(own[old_protected : state.shared_len]).all()
        shared = max(state.shared_len, old_protected)
        assert state.slots[shared:].tolist() == own[shared:].tolist()
        req.adopt(state)

    def _release(self, i: int, insert: bool, drop_last: bool) -> None:
        req = self.reqs.pop(i)
        self.computed.pop(i)
        committed = len(req.slots) - (1 if drop_last and len(req.slots) > req.protected_len else 0)
        state = self.tree.cache_finished_req(
            req.tokens[:committed],
            req.slots,
            req.protected_len,
            req.last_node,
            insert,
            req.priority,
        )
        assert state.protected_len == 0 and len(state.slots) == 0

    def _tree_slots(self) -> list[int]:
        return [s for node in self.tree.iter_nodes() for s in node.value.tolist()]

    def _held_slots(self) -> set[int]:
        held = set(self._tree_slots())
        for req in self.reqs:
            held |= set(req.slots.tolist())
        return held

    def _assert_fresh(self, new: np.ndarray) -> None:
        """Newly handed-out slots are not held by anyone else (the allocator already marked them)."""
        assert not set(new.tolist()) & self._held_slots(), "a slot was handed out twice"


class PagedCacheMachine(CacheMachine):
    page_size = 4
    capacity = 96


_settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestCacheMachinePage1 = CacheMachine.TestCase
TestCacheMachinePage1.settings = _settings
TestCacheMachinePage4 = PagedCacheMachine.TestCase
TestCacheMachinePage4.settings = _settings


ops_st = st.lists(st.tuples(st.sampled_from(["admit", "finish", "evict"]), tokens_st), max_size=30)


def replay(ops: list[tuple[str, list[int]]], page_size: int) -> list[list[int]]:
    """Run a trace of admissions, finishes and evictions; log every slot id handed out or freed."""
    alloc, tree = make_cache(16 * page_size, page_size, "lru")
    reqs: list[FakeReq] = []
    log = []
    for op, tokens in ops:
        if op == "admit" and (req := admit(alloc, tree, tokens)) is not None:
            reqs.append(req)
            log.append(req.slots.tolist())
        elif op == "finish" and reqs:
            req = reqs.pop(len(tokens) % len(reqs))
            tree.cache_finished_req(req.tokens, req.slots, req.protected_len, req.last_node)
        elif op == "evict":
            tree.evict(len(tokens))
        log.append(alloc.free_pages().tolist())
    return log


@settings(max_examples=50, deadline=None)
@given(ops=ops_st, page_size=st.sampled_from([1, 4]))
def test_same_trace_same_slot_ids(ops: list[tuple[str, list[int]]], page_size: int) -> None:
    assert replay(ops, page_size) == replay(ops, page_size)
