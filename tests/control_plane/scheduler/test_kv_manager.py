"""KvManager: the cache operations the scheduler calls, on hand-built pools
(docs/scheduler.md#decode-memory-check, #retraction, #radix-cache).

Every expected number below is worked out by hand from the spec's rule and the state the test builds;
none is computed with the code's formula.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from control_plane.cache.invariants import check_pool_invariants
from control_plane.cache.radix import RadixCache
from control_plane.request import Request
from control_plane.scheduler.kv import KvManager, eviction_priority
from control_plane.scheduler.scheduler import Scheduler
from tests.control_plane.factories import FakeWorker, make_scheduler, params, prompt, run

MAX_INT = 2**63 - 1


def make_kv(capacity: int, page_size: int = 1, policy: str = "lru", low_first: bool = False) -> KvManager:
    return KvManager(
        capacity,
        page_size,
        max_running_requests=8,
        max_context=256,
        eviction_policy=policy,
        low_priority_values_first=low_first,
    )


def tokens(n: int, base: int) -> list[int]:
    """n token ids that share no first token with another `base` (distinct tree branches)."""
    return [base + i for i in range(n)]


def cache_unlocked(kv: KvManager, ids: list[int]) -> None:
    """Put `ids` in the tree as a new unlocked leaf (what a finished request leaves behind)."""
    slots = kv.allocator.alloc(len(ids))
    assert slots is not None
    assert kv.tree.insert(ids, slots) == 0


def prefill(kv: KvManager, rid: str, ids: list[int], priority: int | None = None) -> Request:
    """Admit and prefill `ids` as the scheduler does: match (never the last token), lock, allocate the
    extend, commit it, then docs/scheduler.md#caching-requests's cache_unfinished_req (the request goes on
    decoding)."""
    req = Request(rid=rid, origin_input_ids=list(ids), params=params(16))
    req.priority = priority
    kv.match_prefix(req, len(ids) - 1)
    kv.inc_lock(req.last_node)
    req.cache_protected_len = len(req.prefix_indices)
    req.extend_range = (len(req.prefix_indices), len(ids))
    kv.alloc_for_extend([req])
    req.kv_committed_len = len(ids)
    req.handle = 1
    kv.cache_unfinished_req(req)
    return req


def decode(kv: KvManager, req: Request, n: int) -> None:
    """n decode steps: a slot for position kv_committed_len each, then the sampled token."""
    for _ in range(n):
        rows = np.array([req.req_pool_idx], dtype=np.int64)
        kv.alloc_for_decode(rows, np.array([req.kv_committed_len], dtype=np.int64))
        req.kv_committed_len += 1
        req.append_output(7)


def cached_len(kv: KvManager, ids: list[int]) -> int:
    return len(kv.tree.match_prefix(ids).indices)


def private_slots(kv: KvManager, reqs: list[Request]) -> int:
    page = kv.page_size
    return sum(-(-r.kv_committed_len // page) * page - r.cache_protected_len for r in reqs)


# --- docs/scheduler.md#radix-cache / docs/scheduler.md#locks-and-eviction: priority eviction
# ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("low_first", "vip_priority", "bulk_priority"),
    [
        (False, 5, 1),  # default: larger values are more important
        (True, 1, 5),  # --schedule-low-priority-values-first: smaller values are more important
        (False, None, -3),  # None counts as 0 (`getattr(req, "priority", 0) or 0`, radix_cache.py l.437)
    ],
)
def test_the_more_important_prompt_outlives_a_newer_less_important_one(
    low_first: bool, vip_priority: int | None, bulk_priority: int
) -> None:
    """docs/scheduler.md#radix-cache (`insert` l.415: node priority = max(existing, new)) and
    docs/scheduler.md#locks-and-eviction (priority policy: evict by
    (priority, last_access_time)). The VIP prompt is cached first, so plain LRU would evict it first."""
    kv = make_kv(16, policy="priority", low_first=low_first)
    vip_ids, bulk_ids = tokens(6, 100), tokens(6, 200)
    vip = prefill(kv, "vip", vip_ids, vip_priority)
    kv.cache_finished_req(vip)  # prompt in the tree: 6 evictable
    bulk = prefill(kv, "bulk", bulk_ids, bulk_priority)
    kv.cache_finished_req(bulk)  # 12 evictable, 4 free; bulk's leaf is the most recently used
    assert (kv.available_size(), kv.evictable_size()) == (4, 12)
    kv.evict_for(6)  # 4 free < 6: evict 6 tokens' worth = exactly one whole 6-token leaf
    assert (cached_len(kv, vip_ids), cached_len(kv, bulk_ids)) == (6, 0)


def test_priority_given_at_prefill_is_kept_when_the_request_is_retracted() -> None:
    """docs/scheduler.md#caching-requests (`cache_unfinished_req` l.490 inserts with the request's
    priority) and docs/scheduler.md#retraction (retraction
    inserts nothing, the prompt stays cached): the prompt keeps the priority of its prefill insert."""
    kv = make_kv(16, policy="priority")
    vip_ids, bulk_ids = tokens(6, 100), tokens(6, 200)
    vip = prefill(kv, "vip", vip_ids, priority=9)
    kv.release_req(vip, remaining=0, retract_decode_steps=20)
    bulk = prefill(kv, "bulk", bulk_ids, priority=0)
    kv.cache_finished_req(bulk)
    kv.evict_for(6)
    assert (cached_len(kv, vip_ids), cached_len(kv, bulk_ids)) == (6, 0)


def test_lru_ignores_priority() -> None:
    """The same trace under lru evicts the older VIP prompt: priority only matters to its policy."""
    kv = make_kv(16, policy="lru")
    vip_ids, bulk_ids = tokens(6, 100), tokens(6, 200)
    kv.cache_finished_req(prefill(kv, "vip", vip_ids, 5))
    kv.cache_finished_req(prefill(kv, "bulk", bulk_ids, 1))
    kv.evict_for(6)
    assert (cached_len(kv, vip_ids), cached_len(kv, bulk_ids)) == (0, 6)


def run_vip_then_bulk(vip_priority: int, bulk_priority: int, **config: object) -> Scheduler:
    """End to end through the Scheduler (64 slots, page 1). "vip" (10-token prompt) and then "bulk"
    (30-token prompt) finish with 2 outputs each and leave 11 and 31 tokens cached (the last sampled token
    has no KV, docs/scheduler.md#caching-requests): 42 evictable, 22 free. "late" (24-token prompt) needs
    24 > 22 and evicts 24 tokens' worth: bulk's 31-token leaf alone covers it when bulk ranks lower, while
    LRU would take
    vip's older leaf first."""
    arrivals = [
        (0, "vip", prompt(10, 1), params(2, priority=vip_priority)),
        (10, "bulk", prompt(30, 2), params(2, priority=bulk_priority)),
        (20, "late", prompt(24, 3), params(2, priority=bulk_priority)),
    ]
    sched = make_scheduler(capacity=64, radix_eviction_policy="priority", **config)
    out = run(sched, FakeWorker(64), arrivals)
    assert sorted(out.finished) == ["bulk", "late", "vip"]
    return sched


def test_scheduler_with_priority_eviction_keeps_the_important_prefix() -> None:
    sched = run_vip_then_bulk(10, 0)
    assert len(sched.kv.tree.match_prefix(prompt(10, 1)).indices) == 10
    assert len(sched.kv.tree.match_prefix(prompt(30, 2)).indices) == 0


def test_scheduler_with_low_values_first_keeps_the_important_prefix() -> None:
    sched = run_vip_then_bulk(1, 10, enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    assert len(sched.kv.tree.match_prefix(prompt(10, 1)).indices) == 10
    assert len(sched.kv.tree.match_prefix(prompt(30, 2)).indices) == 0


@pytest.mark.parametrize("low_first", [False, True])
def test_eviction_priority_ranks_like_the_scheduler(low_first: bool) -> None:
    """More important (as the scheduler ranks priorities) must mean a larger tree priority. The
    scheduler's rule: with low_first smaller values are more important, else larger ones; a request
    without a priority under priority scheduling gets the least important value (docs/scheduler.md#intake)."""
    least = MAX_INT if low_first else -MAX_INT - 1
    by_importance = [least, 10, 3, -4] if low_first else [least, -4, 3, 10]  # least important first
    reqs = []
    for p in by_importance:
        req = Request(rid=str(p), origin_input_ids=[1], params=params(1))
        req.priority = p
        reqs.append(req)
    ranks = [eviction_priority(r, low_first) for r in reqs]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    unset = Request(rid="none", origin_input_ids=[1], params=params(1))
    assert eviction_priority(unset, low_first) == 0


# --- docs/scheduler.md#locks-and-eviction / docs/scheduler.md#allocation: eviction before an extend
# allocation ---------------------------------------------


def extend_req(rid: str, n: int) -> Request:
    req = Request(rid=rid, origin_input_ids=tokens(n, 500), params=params(4))
    req.extend_range = (0, n)
    return req


def test_page1_extend_that_fits_evicts_nothing() -> None:
    """docs/scheduler.md#locks-and-eviction, #allocation, page 1: `alloc_token_slots(tree,
    extend_num_tokens)` (allocation.py) evicts only when
    available < the tokens requested. 10 free, 10 requested: nothing is evicted."""
    kv = make_kv(20)
    cache_unlocked(kv, tokens(10, 100))
    assert (kv.available_size(), kv.evictable_size()) == (10, 10)
    kv.alloc_for_extend([extend_req("a", 6), extend_req("b", 4)])
    assert (kv.available_size(), kv.evictable_size()) == (0, 10)


def test_page1_extend_that_does_not_fit_evicts_the_whole_request_not_the_shortfall() -> None:
    """8 free, 9 requested: evict 9 tokens' worth (docs/scheduler.md#locks-and-eviction: `n`, not the
    shortfall of 1), i.e. both
    6-token leaves (whole nodes: the first frees only 6 < 9)."""
    kv = make_kv(20)
    cache_unlocked(kv, tokens(6, 100))
    cache_unlocked(kv, tokens(6, 200))
    assert (kv.available_size(), kv.evictable_size()) == (8, 12)
    kv.alloc_for_extend([extend_req("a", 9)])
    assert (kv.available_size(), kv.evictable_size()) == (20 - 9, 0)


def test_paged_extend_reserves_one_page_per_request() -> None:
    """docs/scheduler.md#locks-and-eviction, page > 1: `alloc_paged_token_slots_extend` evicts extend
    tokens + bs·page_size. Page 4, 24 free, 8 cached: extend 20 for one request needs 20 + 4 = 24 (fits,
    no eviction);
    extend 21 needs 25 > 24 and evicts 25 tokens' worth, i.e. the whole 8-token leaf."""
    kv = make_kv(32, page_size=4)
    cache_unlocked(kv, tokens(8, 100))
    kv.alloc_for_extend([extend_req("a", 20)])
    assert (kv.available_size(), kv.evictable_size()) == (24 - 20, 8)

    kv = make_kv(32, page_size=4)
    cache_unlocked(kv, tokens(8, 100))
    kv.alloc_for_extend([extend_req("a", 21)])
    assert (kv.available_size(), kv.evictable_size()) == (32 - 24, 0)  # 21 tokens use 6 pages


# --- docs/scheduler.md#decode-memory-check: the decode memory need
# ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("page_size", "seq_lens", "need"),
    [
        # next positions 4, 8, 12 start a page (3 pages); 5, 11, 3 continue one
        (4, [4, 5, 8, 11, 12, 3], 12),
        (4, [1, 2, 3, 5, 6, 7], 0),
        (4, [16, 16], 8),
        (2, [2, 3, 4], 4),
        (1, [4, 5, 8], 3),  # page 1: the batch size
        (4, [], 0),
    ],
)
def test_decode_need_is_a_page_per_request_at_a_page_boundary(
    page_size: int, seq_lens: list[int], need: int
) -> None:
    """docs/scheduler.md#decode-memory-check (`new_tokens_required_next_decode`, schedule_batch.py l.2594)."""
    kv = make_kv(64, page_size=page_size)
    assert kv.decode_need(np.array(seq_lens, dtype=np.int64)) == need


def decode_pool() -> KvManager:
    """Page 4, 32 slots: three unlocked 8-token prompts (oldest first) and 8 free slots."""
    kv = make_kv(32, page_size=4)
    for base in (100, 200, 300):
        cache_unlocked(kv, tokens(8, base))
    assert (kv.available_size(), kv.evictable_size()) == (8, 24)
    return kv


def test_check_decode_mem_that_fits_evicts_nothing() -> None:
    kv = decode_pool()
    assert kv.check_decode_mem(np.array([4, 9, 10], dtype=np.int64))  # one page of 4 ≤ 8 free
    assert (kv.available_size(), kv.evictable_size()) == (8, 24)


def test_check_decode_mem_evicts_the_whole_need_when_short() -> None:
    """Need = 3 pages = 12 > 8 free: evict 12 tokens' worth (not the shortfall of 4), LRU whole
    leaves: the two oldest prompts (8 + 8 = 16 ≥ 12); the newest stays."""
    kv = decode_pool()
    assert kv.check_decode_mem(np.array([4, 8, 12, 5], dtype=np.int64))
    assert (kv.available_size(), kv.evictable_size()) == (24, 8)
    assert cached_len(kv, tokens(8, 300)) == 8 and cached_len(kv, tokens(8, 100)) == 0


def test_check_decode_mem_fails_when_even_eviction_cannot_cover_it() -> None:
    """Need = 9 pages = 36 > 32 slots: everything evictable goes and the check still says no."""
    kv = decode_pool()
    assert not kv.check_decode_mem(np.array([4 * k for k in range(1, 10)], dtype=np.int64))
    assert (kv.available_size(), kv.evictable_size()) == (32, 0)


def test_paged_decode_allocation_evicts_a_page_per_request_when_fewer_are_free() -> None:
    """docs/scheduler.md#allocation (SGLang's `alloc_paged_token_slots_decode`): before the decode
    allocation, make room for `len(seq_lens) · P` = 2 · 4 = 8 tokens whenever fewer are free, even
    though neither sequence starts a page (the allocation takes none). 36 slots: an unlocked 8-token
    prompt and two running 10-token ones (3 pages each) leave 4 free < 8: evict 8, the old prompt's
    whole leaf."""
    kv = make_kv(36, page_size=4)
    cache_unlocked(kv, tokens(8, 100))
    reqs = [prefill(kv, f"r{i}", tokens(10, 200 + 100 * i)) for i in range(2)]
    assert (kv.available_size(), kv.evictable_size()) == (4, 8)
    seq_lens = np.array([10, 10], dtype=np.int64)
    assert kv.decode_need(seq_lens) == 0 and kv.check_decode_mem(seq_lens)
    assert (kv.available_size(), kv.evictable_size()) == (4, 8)  # the check stays exact
    rows = np.array([r.req_pool_idx for r in reqs], dtype=np.int64)
    kv.alloc_for_decode(rows, seq_lens)
    assert (kv.available_size(), kv.evictable_size()) == (12, 0)
    assert cached_len(kv, tokens(8, 100)) == 0


def test_paged_decode_allocation_with_enough_free_evicts_nothing() -> None:
    """As above with a 4-token old prompt: 8 free, not fewer than 2 · 4, so nothing is evicted."""
    kv = make_kv(36, page_size=4)
    cache_unlocked(kv, tokens(4, 100))
    reqs = [prefill(kv, f"r{i}", tokens(10, 200 + 100 * i)) for i in range(2)]
    assert (kv.available_size(), kv.evictable_size()) == (8, 4)
    rows = np.array([r.req_pool_idx for r in reqs], dtype=np.int64)
    kv.alloc_for_decode(rows, np.array([10, 10], dtype=np.int64))
    assert (kv.available_size(), kv.evictable_size()) == (8, 4)


def test_a_cached_prompt_is_lost_to_the_decode_allocations_page_per_request() -> None:
    """The minimal case of docs/scheduler.md#allocation (page 16, KV 1,024): a finished request's 96-token
    prompt stays cached (E = 96); four 200-token requests decode, and at position 208 each takes a
    page: A = 1,024 − 96 − 4 · 208 − 4 · 16 = 32. The next decode starts no page (the check needs 0),
    but its allocation makes room for 4 · 16 = 64 > 32 tokens: the 96-token prompt, the only evictable
    leaf, goes. So a request sharing that prompt, arriving now, is admitted with nothing cached (SGLang
    matches 0 tokens; evicting only the exact need kept all 96)."""
    sched = make_scheduler(capacity=1024, page_size=16)
    worker = FakeWorker(1024)
    shared = prompt(96, 1)
    sched.add_request("p", shared, params(1, ignore_eos=True))
    step(sched, worker)
    assert (sched.kv.available_size(), sched.kv.evictable_size()) == (928, 96)
    for i in range(4):
        sched.add_request(f"d{i}", prompt(200, 10 + i), params(12, ignore_eos=True))
    while sched.kv.available_size() >= 64:
        step(sched, worker)
    assert (sched.kv.available_size(), sched.kv.evictable_size()) == (32, 96)
    sched.add_request("q", [*shared, *prompt(20, 7)], params(4, ignore_eos=True))
    q = sched.requests["q"]
    plan = step(sched, worker)  # q does not fit beside the four; their decode allocation evicts
    assert len(plan.decodes.handles) == 4 and not len(plan.extends.handles)
    assert (sched.kv.available_size(), sched.kv.evictable_size()) == (128, 0)
    while q.handle < 0:
        step(sched, worker)
    assert q.extend_range == (0, 116) and q.cached_tokens == 0


def step(sched: Scheduler, worker: FakeWorker) -> Any:
    plan = sched.next_plan()
    assert plan is not None
    sched.apply_result(worker.run(plan))
    sched.take_updates()
    return plan


# --- docs/scheduler.md#retraction: release_req for retraction
# --------------------------------------------------------------


def retraction_pool() -> tuple[KvManager, Request, list[list[int]]]:
    """Page 1, 40 slots: four unlocked 5-token prompts (oldest first), and a running request whose
    10-token prompt is in the tree (locked) with 4 decoded tokens in private slots. Free: 40 − 20 −
    10 − 4 = 6."""
    kv = make_kv(40)
    olds = [tokens(5, base) for base in (100, 200, 300, 400)]
    for ids in olds:
        cache_unlocked(kv, ids)
    req = prefill(kv, "r", tokens(10, 500))
    decode(kv, req, 4)
    assert (kv.available_size(), kv.evictable_size(), kv.protected_size()) == (6, 20, 10)
    check_pool_invariants(kv.allocator, kv.tree, private_slots(kv, [req]))
    return kv, req, olds


def test_release_req_frees_private_slots_and_unlocks_the_prompt() -> None:
    """docs/scheduler.md#retraction step 2: no insert; the 4 private slots are freed; the prompt stays
    cached, now evictable.
    remaining·steps = 1·8 = 8 ≤ 10 free: nothing is evicted (step 3)."""
    kv, req, _ = retraction_pool()
    kv.release_req(req, remaining=1, retract_decode_steps=8)
    assert (kv.available_size(), kv.evictable_size(), kv.protected_size()) == (10, 30, 0)
    assert cached_len(kv, [*tokens(10, 500), 7]) == 10 and req.req_pool_idx == -1
    check_pool_invariants(kv.allocator, kv.tree, 0)


def test_release_req_evicts_remaining_times_decode_steps() -> None:
    """docs/scheduler.md#retraction step 3: `evict_from_tree_cache(tree, remaining ·
    SGLANG_RETRACT_DECODE_STEPS)` (schedule_batch.py:release_req l.1714). After the release 10 are free;
    3·4 = 12 > 10, so 12 tokens' worth go, LRU whole leaves: the three oldest 5-token prompts (15 ≥ 12).
    The shortfall (2) would
    have taken only one."""
    kv, req, olds = retraction_pool()
    kv.release_req(req, remaining=3, retract_decode_steps=4)
    assert (kv.available_size(), kv.evictable_size()) == (25, 15)
    assert [cached_len(kv, ids) for ids in olds] == [0, 0, 0, 5]
    assert cached_len(kv, tokens(10, 500)) == 10
    check_pool_invariants(kv.allocator, kv.tree, 0)


def test_release_of_the_last_request_evicts_nothing() -> None:
    """remaining = 0 (the OOM abort of the last request): 0 tokens to evict."""
    kv, req, _ = retraction_pool()
    kv.release_req(req, remaining=0, retract_decode_steps=20)
    assert (kv.available_size(), kv.evictable_size()) == (10, 30)


# --- docs/scheduler.md#caching-requests / docs/scheduler.md#caching-requests: one implementation, the tree's,
# behind KvManager ---------------------------------


def test_kv_manager_caches_requests_through_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """KvManager's docs/scheduler.md#caching-requests are RadixCache.cache_finished_req /
    cache_unfinished_req (one
    implementation, the one the property tests drive), not a copy of them."""
    calls: list[str] = []

    def spy(name: str) -> Callable[..., Any]:
        original = getattr(RadixCache, name)

        def wrapper(self: RadixCache, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("cache_finished_req", "cache_unfinished_req"):
        monkeypatch.setattr(RadixCache, name, spy(name))
    kv = make_kv(32)
    req = prefill(kv, "a", tokens(6, 100))
    kv.cache_finished_req(req)
    assert calls == ["cache_unfinished_req", "cache_finished_req"]


def test_unfinished_req_remaps_a_prefix_the_tree_got_meanwhile() -> None:
    """docs/scheduler.md#caching-requests: the request computed [1,2,3,4,9] while [1,2,3,4,7] was cached
    by someone else. Its own slots for positions 0..3 are freed, its row and prefix_indices now name the
    tree's, and the worker
    is told to read the tree's copies (a remap of positions [0, 4))."""
    kv = make_kv(32)
    req = Request(rid="late", origin_input_ids=[1, 2, 3, 4, 9], params=params(4))
    kv.match_prefix(req, 4)
    kv.inc_lock(req.last_node)
    req.extend_range = (0, 5)
    own = kv.alloc_for_extend([req])[0].copy()
    req.kv_committed_len, req.handle = 5, 3
    tree_slots = kv.allocator.alloc(5)
    assert tree_slots is not None
    kv.tree.insert([1, 2, 3, 4, 7], tree_slots)
    remap = kv.cache_unfinished_req(req)
    assert remap is not None
    assert (remap.handle, remap.start, remap.slots.tolist()) == (3, 0, tree_slots[:4].tolist())
    assert kv.row(req)[:5].tolist() == [*tree_slots[:4].tolist(), int(own[4])]
    assert req.prefix_indices.tolist() == kv.row(req)[:5].tolist()
    assert req.cache_protected_len == 5 and kv.allocator.is_free(own[:4]).all()
    assert kv.protected_size() == 5 and kv.evictable_size() == 1  # [7] stays unlocked
    check_pool_invariants(kv.allocator, kv.tree, 0)


def test_unfinished_req_without_a_shared_prefix_needs_no_remap() -> None:
    kv = make_kv(32, page_size=4)
    req = prefill(kv, "a", tokens(10, 100))  # prefill calls cache_unfinished_req once already
    assert (req.cache_protected_len, len(req.prefix_indices)) == (8, 10)
    decode(kv, req, 2)
    assert kv.cache_unfinished_req(req) is None  # nothing new was shared: positions 8..11 are its own
    assert req.cache_protected_len == 12 and kv.protected_size() == 12
    check_pool_invariants(kv.allocator, kv.tree, 0)


def test_a_freed_row_is_taken_again_before_an_untouched_one() -> None:
    """Requests that come and go one at a time keep reusing row 0: the row table grows with the
    requests held at once, not with every row ever handed out (the twin's workers run thousands of
    requests each; rotating through all max_running_requests rows grew each table to its limit)."""
    kv = make_kv(capacity=1000)
    for i in range(20):
        req = prefill(kv, f"r{i}", tokens(10, 1000 * (i + 1)))
        assert req.req_pool_idx == 0
        kv.cache_finished_req(req)
    assert kv.req_to_token.shape[0] == 1
    held = [prefill(kv, f"h{i}", tokens(10, 100_000 + 1000 * i)) for i in range(3)]
    kv.cache_finished_req(held[1])
    assert prefill(kv, "again", tokens(10, 900_000)).req_pool_idx == 1
