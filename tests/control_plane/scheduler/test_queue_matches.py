"""Kept matches of the waiting queue (docs/scheduler.md#kept-matches): after any sequence of tree
changes and queue changes, every waiting request's kept match is what a fresh match finds, and only
requests whose path changed are matched again."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from control_plane.cache.radix import RadixCache
from control_plane.request import Request
from control_plane.scheduler.policy import LPM_FALLBACK_QUEUE_LEN
from control_plane.scheduler.queue_matches import QueueMatches
from control_plane.scheduler.scheduler import Scheduler
from tests.control_plane.cache.helpers import insert_fresh, make_cache
from tests.control_plane.factories import make_scheduler, params, prompt, run
from tests.control_plane.fake_worker import FakeWorker

# A tiny vocabulary: prompts share prefixes, split nodes and collide often.
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=14)


def fresh_len(tree: RadixCache, req: Request) -> int:
    return len(tree.match_prefix(req.fill_ids[: req.seqlen]).indices)


class KeptMatchMachine(RuleBasedStateMachine):
    capacity = 40

    def __init__(self) -> None:
        super().__init__()
        self.queue: list[Request] = []
        self.count = 0

    @initialize(page_size=st.sampled_from([1, 2]), policy=st.sampled_from(["lru", "lfu", "mru"]))
    def setup(self, page_size: int, policy: str) -> None:
        self.alloc, self.tree = make_cache(self.capacity, page_size, policy)
        self.matches = QueueMatches(self.tree, check=4, deprioritize=3)

    @rule(tokens=tokens_st)
    def arrive(self, tokens: list[int]) -> None:
        self.count += 1
        req = Request(rid=f"r{self.count}", origin_input_ids=tokens, params=params())
        req.wait_queue_entry_time = self.count
        self.queue.append(req)
        self.matches.joined(req)

    @precondition(lambda self: self.queue)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """A request leaves the queue and its prompt is computed into the tree."""
        req = self.queue.pop(data.draw(st.integers(0, len(self.queue) - 1)))
        self.matches.left(req)
        self._insert(list(req.origin_input_ids))

    @rule(tokens=tokens_st)
    def insert(self, tokens: list[int]) -> None:
        self._insert(tokens)

    @rule(n=st.integers(1, 12))
    def evict(self, n: int) -> None:
        self.tree.evict(n)

    @rule(tokens=tokens_st)
    def match(self, tokens: list[int]) -> None:
        """Another match splits a node where it stops inside one."""
        self.tree.match_prefix(tokens)

    @precondition(lambda self: self.queue)
    @rule()
    def sync(self) -> None:
        self.matches.sync(self.queue)

    @rule()
    def reset(self) -> None:
        self.tree.reset()

    def _insert(self, tokens: list[int]) -> None:
        page = self.tree.page_size
        need = -(-len(tokens) // page) * page
        if need > self.alloc.available_size():
            self.tree.evict(need)
        if need <= self.alloc.available_size():
            insert_fresh(self.alloc, self.tree, tokens)

    @invariant()
    def kept_equals_fresh(self) -> None:
        kept = self.matches.kept(self.queue)
        assert self.matches.resyncs == 0  # the queue told of every change
        assert [k.req for k in kept] == self.queue
        for k in kept:  # the node first: peek touches nothing, a real match may split
            assert k.node is self.tree.peek(k.req.fill_ids.tobytes()).node
        for k in kept:
            assert k.tokens == fresh_len(self.tree, k.req), k.req.rid
            assert k.req.num_matched_prefix_tokens == min(k.tokens, k.req.seqlen - 1)

    @invariant()
    def dedup_defers_all_but_the_earliest_of_a_group(self) -> None:
        """Match at most `check` = 4 tokens and share the first 3 with an earlier such request."""
        self.matches.sync(self.queue)
        heads: set[tuple[int, ...]] = set()
        expected = set()
        for req in sorted(self.queue, key=lambda r: r.wait_queue_entry_time):
            head = tuple(req.origin_input_ids[:3])
            if len(req.origin_input_ids) < 3 or fresh_len(self.tree, req) > 4:
                continue
            if head in heads:
                expected.add(req.rid)
            heads.add(head)
        assert self.matches.deprioritized(self.queue) == expected


TestKeptMatches = KeptMatchMachine.TestCase
TestKeptMatches.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_change_elsewhere_matches_nothing_again() -> None:
    alloc, tree = make_cache(4096)
    matches = QueueMatches(tree, check=32, deprioritize=32)
    a, b = prompt(100, 1), prompt(100, 2)
    insert_fresh(alloc, tree, a[:50])
    queue = [
        Request(rid=f"a{i}", origin_input_ids=a[:60] + prompt(5, 10 + i), params=params()) for i in range(50)
    ]
    matches.sync(queue)
    assert matches.rematches == 50
    insert_fresh(alloc, tree, b)  # another path
    tree.match_prefix(b[:30])  # splits b's node, which no waiting request ends in
    tree.match_prefix(a[:50])  # a is the most recently used now
    tree.evict(1)  # so b's lower part goes (lru)
    matches.sync(queue)
    assert matches.rematches == 50
    insert_fresh(alloc, tree, a[:60])  # extends every waiting request's path
    kept = matches.kept(queue)
    assert matches.rematches == 100
    assert {k.tokens for k in kept} == {60}


def test_deep_lpm_reads_kept_matches_through_a_whole_run() -> None:
    """The scheduler's own inserts, locks, chunked caching and evictions: after every step, every
    waiting request's kept match is what a fresh match finds."""
    sched = make_scheduler(
        capacity=3000, schedule_policy="lpm", cache_aware_queue_limit=0, chunked_prefill_size=64
    )
    groups = [prompt(48, 500 + g) for g in range(40)]
    arrivals = [(i // 20, f"r{i}", groups[(i * 7) % 40] + prompt(20, i), params(4)) for i in range(400)]
    deep = 0

    def check(s: Scheduler, step: int) -> None:
        nonlocal deep
        matcher = s.policy.matcher  # type: ignore[attr-defined]
        if len(s.waiting) <= LPM_FALLBACK_QUEUE_LEN:
            return
        deep += 1
        for k in matcher.kept.kept(s.waiting):
            assert k.tokens == s.kv.tree.peek(k.req.fill_ids[: k.req.seqlen].tobytes()).tokens

    out = run(sched, FakeWorker(3000, vocab=1000), arrivals, on_step=check)
    assert len(out.finished) == 400
    assert deep > 10
    kept = sched.policy.matcher.kept  # type: ignore[attr-defined]
    assert kept.rematches < 400 * deep
    assert kept.resyncs == 0  # the queue told of every arrival and departure


def test_a_shallow_queue_keeps_nothing_of_the_departed() -> None:
    """Arrivals and departures with no pass to sync them (the queue never passes 128): the pending
    list stays within a constant factor of the queue."""
    _, tree = make_cache(64)
    matches = QueueMatches(tree, check=32, deprioritize=32)
    for i in range(5000):
        req = Request(rid=f"r{i}", origin_input_ids=prompt(8, i), params=params())
        req.wait_queue_entry_time = i
        matches.joined(req)
        matches.left(req)
    assert len(matches._stale) <= 64
