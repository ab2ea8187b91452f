"""cache_finished_req / cache_unfinished_req on plain request state (docs/scheduler.md#caching-requests,
#retraction).

These are the only implementation of docs/scheduler.md#caching-requests: the scheduler reaches them through
KvManager
(tests/control_plane/scheduler/test_kv_manager.py covers that adapter)."""

from __future__ import annotations

import numpy as np
import pytest

from control_plane.cache.invariants import check_pool_invariants
from tests.control_plane.cache.helpers import admit, decode, insert_fresh, make_cache


def test_unfinished_req_shares_its_prefix_and_moves_the_lock() -> None:
    alloc, tree = make_cache(capacity=32)
    req = admit(alloc, tree, [1, 2, 3, 4, 5, 6])
    assert req is not None and req.last_node is tree.root and req.protected_len == 0
    check_pool_invariants(alloc, tree, req.private_slots(1))
    state = tree.cache_unfinished_req(req.tokens, req.slots, req.protected_len, req.last_node)
    assert state.protected_len == 6 and state.slots.tolist() == req.slots.tolist()
    assert state.last_node.lock_ref == 1
    assert (tree.protected_size(), tree.evictable_size()) == (6, 0)
    check_pool_invariants(alloc, tree, 0)


def test_finished_req_inserts_outputs_and_unlocks() -> None:
    alloc, tree = make_cache(capacity=32)
    req = admit(alloc, tree, [1, 2, 3, 4])
    assert req is not None
    req.adopt(tree.cache_unfinished_req(req.tokens, req.slots, req.protected_len, req.last_node))
    assert decode(alloc, req, 5) and decode(alloc, req, 6)
    state = tree.cache_finished_req(req.tokens, req.slots, req.protected_len, req.last_node)
    assert state.last_node is tree.root and state.protected_len == 0 and len(state.slots) == 0
    assert (tree.protected_size(), tree.evictable_size()) == (0, 6)
    assert alloc.available_size() == 26
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == req.slots.tolist()
    check_pool_invariants(alloc, tree, 0)


def test_duplicate_slots_are_freed_and_the_tree_keeps_its_own() -> None:
    alloc, tree = make_cache(capacity=32)
    early = admit(alloc, tree, [1, 2, 3, 4, 5])
    late = admit(alloc, tree, [1, 2, 3, 4, 5])  # admitted before `early` was cached: computes it again
    assert early is not None and late is not None
    tree.cache_finished_req(early.tokens, early.slots, early.protected_len, early.last_node)
    tree.cache_finished_req(late.tokens, late.slots, late.protected_len, late.last_node)
    assert tree.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == early.slots.tolist()
    assert alloc.is_free(late.slots).all()
    check_pool_invariants(alloc, tree, 0)


def test_unfinished_req_swaps_in_the_tree_slots_for_a_cached_prefix() -> None:
    alloc, tree = make_cache(capacity=32)
    late = admit(alloc, tree, [1, 2, 3, 4, 9])
    cached = insert_fresh(alloc, tree, [1, 2, 3, 4, 7])
    assert late is not None
    state = tree.cache_unfinished_req(late.tokens, late.slots, late.protected_len, late.last_node)
    assert state.slots[:4].tolist() == cached[:4].tolist()
    assert state.slots[4] == late.slots[4] and (state.protected_len, state.shared_len) == (5, 4)
    assert alloc.is_free(late.slots[:4]).all()
    check_pool_invariants(alloc, tree, 0)


def test_chunked_prefill_keeps_the_unaligned_tail_private() -> None:
    alloc, tree = make_cache(capacity=32, page_size=4)
    tokens = list(range(100, 114))
    req = admit(alloc, tree, tokens, extend=10)  # first chunk: positions 0..9
    assert req is not None
    state = tree.cache_unfinished_req(tokens[:10], req.slots, 0, req.last_node, chunked=True)
    assert state.protected_len == 8 and state.last_node.hit_count == 0
    req.adopt(state)
    check_pool_invariants(alloc, tree, req.private_slots(4))  # the half-used third page
    tail = alloc.alloc_extend(10, int(req.slots[-1]), 4)  # next chunk continues that page
    assert tail is not None and tail[:2].tolist() == [int(req.slots[-1]) + 1, int(req.slots[-1]) + 2]
    req.slots = np.concatenate((req.slots, tail))
    tree.cache_finished_req(tokens, req.slots, req.protected_len, req.last_node)
    assert tree.total_size() == 12 and alloc.available_size() == 20
    check_pool_invariants(alloc, tree, 0)


def test_retraction_frees_private_slots_without_inserting() -> None:
    alloc, tree = make_cache(capacity=32, page_size=2)
    req = admit(alloc, tree, [1, 2, 3, 4, 5])
    assert req is not None
    req.adopt(tree.cache_unfinished_req(req.tokens, req.slots, req.protected_len, req.last_node))
    for token in (6, 7, 8):
        assert decode(alloc, req, token)
    state = tree.cache_finished_req(req.tokens, req.slots, req.protected_len, req.last_node, insert=False)
    assert state.protected_len == 0
    # The prompt stays cached, unlocked (docs/scheduler.md#invariants).
    assert tree.total_size() == tree.evictable_size() == 4
    assert len(tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).indices) == 4
    assert alloc.available_size() == 28
    check_pool_invariants(alloc, tree, 0)


def test_over_allocated_slots_are_freed_at_finish() -> None:
    alloc, tree = make_cache(capacity=16, page_size=2)
    req = admit(alloc, tree, [1, 2, 3])
    assert req is not None and decode(alloc, req, 4) and decode(alloc, req, 5)
    committed = req.tokens[:4]  # the slot of position 4 was reserved but its KV never committed
    tree.cache_finished_req(committed, req.slots, req.protected_len, req.last_node)
    assert tree.total_size() == 4 and alloc.available_size() == 12
    check_pool_invariants(alloc, tree, 0)


def test_disabled_cache_frees_everything_at_finish() -> None:
    alloc, tree = make_cache(capacity=16, disable=True)
    req = admit(alloc, tree, [1, 2, 3])
    assert req is not None
    state = tree.cache_unfinished_req(req.tokens, req.slots, req.protected_len, req.last_node)
    assert state.slots.tolist() == req.slots.tolist() and state.protected_len == 0
    check_pool_invariants(alloc, tree, 3)
    tree.cache_finished_req(req.tokens, state.slots, state.protected_len, state.last_node)
    assert alloc.available_size() == 16
    check_pool_invariants(alloc, tree, 0)


def test_incoherent_request_state_is_refused() -> None:
    alloc, tree = make_cache(capacity=16, page_size=2)
    slots = alloc.alloc(4)
    assert slots is not None
    with pytest.raises(ValueError):
        tree.cache_finished_req([1, 2, 3, 4, 5], slots, 0, tree.root)  # fewer slots than tokens
    with pytest.raises(ValueError):
        tree.cache_unfinished_req([1, 2, 3, 4], slots, 1, tree.root)  # protected length not page-aligned
