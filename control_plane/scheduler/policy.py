"""Waiting-queue ordering policies (docs/scheduler.md#ordering-policies), one small class each, chosen by
name.

`order(queue, running)` reorders the waiting queue in place, once per prefill attempt. Cache-aware
policies (lpm, dfs-weight, hrrn, shortest-prefill-first, lpm-aging) match every waiting request
against the prefix tree, which also sets the request's `prefix_indices` and `last_node`; past 128
waiting requests, where allowed, they read the kept matches of queue_matches.py instead
(docs/scheduler.md#kept-matches). `--max-queue-wait-s` wraps any policy in `StarvationBound`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Protocol

from control_plane.cache.radix import RadixCache
from control_plane.config import SchedulerConfig
from control_plane.request import Request
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.priority import priority_sign, urgency
from control_plane.scheduler.queue_clock import QueueClock
from control_plane.scheduler.queue_matches import QueueMatches

# Past this many waiting requests LPM falls back to FCFS for the pass (per-request matching cost);
# SGLang's constant. With --cache-aware-queue-limit 0 or above it, deeper passes read kept matches.
LPM_FALLBACK_QUEUE_LEN = 128


class Policy(Protocol):
    cache_aware: bool

    def order(self, queue: list[Request], running: Sequence[Request]) -> None: ...


class Fcfs:
    """Arrival order; with priority scheduling, by (priority, queue entry)
    (docs/scheduler.md#ordering-policies step 3)."""

    cache_aware = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.priority = config.enable_priority_scheduling
        self.sign = priority_sign(config.schedule_low_priority_values_first)

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        if self.priority:
            queue.sort(key=lambda r: (urgency(r, self.sign), r.wait_queue_entry_time))


class LongestOutputFirst:
    cache_aware = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.priority = config.enable_priority_scheduling
        self.sign = priority_sign(config.schedule_low_priority_values_first)

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        if self.priority:
            queue.sort(key=lambda r: (urgency(r, self.sign), -r.max_new_tokens))
        else:
            queue.sort(key=lambda r: -r.max_new_tokens)


class RandomOrder:
    """A seeded shuffle of the whole queue on every pass (arrival order is lost, as in SGLang)."""

    cache_aware = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.rng = random.Random(config.random_seed)

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        self.rng.shuffle(queue)


class RoutingKey:
    """Requests whose routing key is most frequent in the running batch first
    (docs/scheduler.md#ordering-policies step 5)."""

    cache_aware = False

    def __init__(self, config: SchedulerConfig) -> None:
        pass

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        counts = Counter(r.params.routing_key for r in running if r.params.routing_key)
        if not counts:
            return

        def key(r: Request) -> tuple[int, int, str]:
            k = r.params.routing_key
            if k and k in counts:
                return (0, -counts[k], k)
            return (1, 0, k or "")

        queue.sort(key=key)


class PrefixMatcher:
    """Matches waiting requests against the real tree and dedups shared prefixes within the queue
    through a simulated tree (docs/scheduler.md#in-batch-prefix-dedup)."""

    def __init__(self, kv: KvManager, config: SchedulerConfig, kept: bool = False) -> None:
        self.kv = kv
        self.check_threshold = config.in_batch_prefix_check_threshold
        self.deprioritize_threshold = config.in_batch_prefix_deprioritize_threshold
        # Kept matches for passes past LPM_FALLBACK_QUEUE_LEN (docs/scheduler.md#kept-matches).
        self.kept = QueueMatches(kv.tree, self.check_threshold, self.deprioritize_threshold) if kept else None
        # --full-prefix-dedup: the prefills planned whose KV is not in the tree yet (the scheduler's).
        self.in_flight: Callable[[], Sequence[Request]] | None = None

    def deep(self, queue: Sequence[Request]) -> bool:
        """Whether this pass reads the kept matches (past 128 waiting, when they are kept)."""
        return self.kept is not None and len(queue) > LPM_FALLBACK_QUEUE_LEN

    def match(self, queue: Sequence[Request]) -> set[str]:
        """`match_all` (SGLang's pass), or past 128 waiting the kept matches. Sets every request's
        num_matched_prefix_tokens; returns the rids to deprioritize."""
        if self.deep(queue):
            return self.match_kept(queue)
        return self.match_all(queue)

    def match_kept(self, queue: Sequence[Request]) -> set[str]:
        """From the kept matches: no tree access, so prefix_indices and last_node are left alone
        (admission matches each request it tries for real)."""
        assert self.kept is not None
        self.kept.sync(queue)
        return self.kept.deprioritized(queue)

    def match_all(self, queue: Sequence[Request]) -> set[str]:
        """Mutates each request's prefix fields; returns the rids to deprioritize."""
        deprioritized: set[str] = set()
        sim = _simulated_tree() if self.check_threshold >= 0 else None
        if sim is not None and self.in_flight is not None:
            for req in self.in_flight():  # as if first in the queue: their KV is not in the tree yet
                sim.insert(req.fill_ids)
        for req in queue:
            self.kv.match_prefix(req, req.seqlen)
            req.num_matched_prefix_tokens = min(len(req.prefix_indices), max(req.seqlen - 1, 0))
            if sim is None:
                continue
            cached = len(req.prefix_indices)
            if cached <= self.check_threshold:
                need = self.deprioritize_threshold
            elif self.in_flight is not None:
                need = cached + self.deprioritize_threshold  # its uncached part, computed by another
            else:
                continue
            fill = req.fill_ids
            if len(sim.match_prefix(fill).indices) >= need:
                deprioritized.add(req.rid)
            else:
                sim.insert(fill)
        return deprioritized


def _simulated_tree() -> RadixCache:
    # No pool behind it: it only answers "how long is the prefix shared with an earlier request".
    return RadixCache(None, page_size=1)


_QUEUE_KEY = attrgetter("queue_key")


def falls_back(queue: Sequence[Request], limit: int) -> bool:
    """Past `limit` waiting requests (0: never) the pass is FCFS's: no matching, no reordering."""
    return 0 < limit < len(queue)


class LongestPrefixMatch:
    cache_aware = True

    def __init__(self, config: SchedulerConfig, matcher: PrefixMatcher) -> None:
        self.matcher = matcher
        self.limit = config.cache_aware_queue_limit

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        if falls_back(queue, self.limit):
            return  # FCFS for this pass
        if self.matcher.deep(queue):
            assert self.matcher.kept is not None
            self.matcher.kept.sync(queue)
            queue.sort(key=_QUEUE_KEY)  # the same order, its keys kept up to date
            return
        deprioritized = self.matcher.match(queue)
        inf = float("inf")
        queue.sort(key=lambda r: inf if r.rid in deprioritized else -r.num_matched_prefix_tokens)


class AgingPrefixMatch:
    """lpm-aging: a stable sort by descending `matched tokens + R × seconds waited` (R:
    --lpm-aging-tokens-per-s, the seconds on the queue clock), deduped requests last
    (docs/scheduler.md#lpm-aging)."""

    cache_aware = True

    def __init__(self, config: SchedulerConfig, matcher: PrefixMatcher, clock: QueueClock) -> None:
        self.matcher = matcher
        self.limit = config.cache_aware_queue_limit
        self.rate = config.lpm_aging_tokens_per_s
        self.clock = clock

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        if falls_back(queue, self.limit):
            return
        deprioritized = self.matcher.match(queue)
        inf, rate, now = float("inf"), self.rate, self.clock.busy_s
        queue.sort(
            key=lambda r: (
                inf
                if r.rid in deprioritized
                else -(r.num_matched_prefix_tokens + rate * (now - r.queue_entry_s))
            )
        )


class HighestResponseRatio:
    """hrrn, as SGLang's current `_sort_by_hrrn`: response ratio 1 + waited / uncached, the wait in
    prefill tokens processed since the request joined the queue (token-based aging), ties by rid
    (docs/scheduler.md#hrrn)."""

    cache_aware = True

    def __init__(self, config: SchedulerConfig, matcher: PrefixMatcher, clock: QueueClock) -> None:
        self.matcher = matcher
        self.limit = config.cache_aware_queue_limit
        self.clock = clock

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        if falls_back(queue, self.limit):
            return
        deprioritized = self.matcher.match(queue)
        processed = self.clock.prefill_tokens
        inf = float("inf")

        def key(r: Request) -> tuple[float, str]:
            if r.rid in deprioritized:
                return (inf, r.rid)
            uncached = len(r.origin_input_ids) - r.num_matched_prefix_tokens
            if uncached <= 0:
                return (-inf, r.rid)
            return (-max(0, processed - r.queue_entry_tokens) / uncached, r.rid)

        queue.sort(key=key)


class ShortestPrefillFirst:
    """shortest-prefill-first, as SGLang's current `_sort_by_shortest_prefill`: by (deduped,
    max(1, uncached tokens), queue entry); no fallback at any depth (docs/scheduler.md#spf)."""

    cache_aware = True

    def __init__(self, config: SchedulerConfig, matcher: PrefixMatcher) -> None:
        self.matcher = matcher

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        deprioritized = self.matcher.match(queue)
        queue.sort(
            key=lambda r: (
                r.rid in deprioritized,
                max(1, r.seqlen - r.num_matched_prefix_tokens),
                r.wait_queue_entry_time,
            )
        )


class EarliestDeadlineFirst:
    """edf: requests with a TTFT objective by deadline (queue entry on the queue clock plus the
    objective, the tenant's default when the request names none), then the rest in arrival order
    (docs/scheduler.md#slo-admission)."""

    cache_aware = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        inf = float("inf")

        def key(r: Request) -> tuple[float, int]:
            slo_ms = ttft_objective_ms(self.config, r)
            deadline = r.queue_entry_s + slo_ms / 1000.0 if slo_ms > 0 else inf
            return (deadline, r.wait_queue_entry_time)

        queue.sort(key=key)


def ttft_objective_ms(config: SchedulerConfig, req: Request) -> float:
    """The request's TTFT objective in ms: its own, else its tenant's default (0: none)."""
    if req.params.ttft_slo_ms > 0:
        return req.params.ttft_slo_ms
    return config.tenant_slos.get(req.params.tenant, (0.0, 0.0))[0]


def tpot_objective_ms(config: SchedulerConfig, req: Request) -> float:
    if req.params.tpot_slo_ms > 0:
        return req.params.tpot_slo_ms
    return config.tenant_slos.get(req.params.tenant, (0.0, 0.0))[1]


class StarvationBound:
    """--max-queue-wait-s: after the policy's order, requests that have waited longer than the bound
    (on the queue clock, since their latest entry) go first, in arrival order
    (docs/scheduler.md#max-queue-wait)."""

    def __init__(self, inner: Policy, bound_s: float, clock: QueueClock) -> None:
        self.inner = inner
        self.cache_aware = inner.cache_aware
        self.bound_s = bound_s
        self.clock = clock

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        self.inner.order(queue, running)
        since = self.clock.busy_s - self.bound_s
        overdue = [r for r in queue if r.queue_entry_s < since]
        if overdue:
            overdue.sort(key=lambda r: r.wait_queue_entry_time)
            late = {id(r) for r in overdue}
            queue[:] = overdue + [r for r in queue if id(r) not in late]


class DfsWeight:
    """Depth-first over the tree, heavier subtrees first, requests after their node's children."""

    cache_aware = True

    def __init__(self, config: SchedulerConfig, matcher: PrefixMatcher) -> None:
        self.matcher = matcher

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        self.matcher.match_all(queue)
        root = self.matcher.kv.tree.root
        by_node: dict[int, list[Request]] = {}
        weight: dict[int, int] = {}
        for req in queue:
            node = req.last_node if req.last_node is not None else root
            by_node.setdefault(id(node), []).append(req)
            while node is not None:
                weight[id(node)] = weight.get(id(node), 0) + 1
                node = node.parent
        out: list[Request] = []
        self._visit(root, by_node, weight, out)
        queue[:] = out

    def _visit(
        self, node: object, by_node: dict[int, list[Request]], weight: dict[int, int], out: list[Request]
    ) -> None:
        children = [c for c in node.children.values() if id(c) in weight]  # type: ignore[attr-defined]
        children.sort(key=lambda c: -weight[id(c)])
        for child in children:
            self._visit(child, by_node, weight, out)
        out.extend(by_node.get(id(node), ()))


PolicyFactory = Callable[[SchedulerConfig, KvManager, QueueClock], Policy]


def _deep(config: SchedulerConfig) -> bool:
    """Whether the cutoff lets a pass go past LPM_FALLBACK_QUEUE_LEN (then matches are kept)."""
    limit = config.cache_aware_queue_limit
    return limit == 0 or limit > LPM_FALLBACK_QUEUE_LEN


def _matcher(config: SchedulerConfig, kv: KvManager, kept: bool) -> PrefixMatcher:
    # --full-prefix-dedup reads no kept matches: its dedup depends on the prefills in flight, which
    # change every step, so every pass matches every waiting request (docs/scheduler.md#full-prefix-dedup).
    return PrefixMatcher(kv, config, kept=kept and not kv.disabled and not config.full_prefix_dedup)


POLICIES: dict[str, PolicyFactory] = {
    "fcfs": lambda config, kv, clock: Fcfs(config),
    "lof": lambda config, kv, clock: LongestOutputFirst(config),
    "random": lambda config, kv, clock: RandomOrder(config),
    "routing-key": lambda config, kv, clock: RoutingKey(config),
    "lpm": lambda config, kv, clock: LongestPrefixMatch(config, _matcher(config, kv, _deep(config))),
    "dfs-weight": lambda config, kv, clock: DfsWeight(config, PrefixMatcher(kv, config)),
    "hrrn": lambda config, kv, clock: HighestResponseRatio(
        config, _matcher(config, kv, _deep(config)), clock
    ),
    "shortest-prefill-first": lambda config, kv, clock: ShortestPrefillFirst(
        config, _matcher(config, kv, True)
    ),
    "lpm-aging": lambda config, kv, clock: AgingPrefixMatch(
        config, _matcher(config, kv, _deep(config)), clock
    ),
    "edf": lambda config, kv, clock: EarliestDeadlineFirst(config),
}


def make_policy(config: SchedulerConfig, kv: KvManager, clock: QueueClock | None = None) -> Policy:
    """The configured policy; a cache-aware one becomes FCFS when the prefix cache is off
    (docs/scheduler.md#ordering-policies); wrapped in the starvation bound when
    --max-queue-wait-s is set."""
    try:
        factory = POLICIES[config.schedule_policy]
    except KeyError:
        raise ValueError(f"Unknown schedule_policy: {config.schedule_policy!r}") from None
    clock = QueueClock() if clock is None else clock
    policy = factory(config, kv, clock)
    if policy.cache_aware and kv.disabled:
        policy = Fcfs(config)
    if config.max_queue_wait_s > 0:
        policy = StarvationBound(policy, config.max_queue_wait_s, clock)
    return policy


def queue_watcher(policy: Policy) -> QueueMatches | None:
    """The kept matches the waiting queue must tell of arrivals and departures, if the policy keeps
    any."""
    matcher = prefix_matcher(policy)
    return matcher.kept if matcher is not None else None


def prefix_matcher(policy: Policy) -> PrefixMatcher | None:
    """The policy's prefix matcher, if it is cache-aware."""
    inner = policy.inner if isinstance(policy, StarvationBound) else policy
    matcher = getattr(inner, "matcher", None)
    return matcher if isinstance(matcher, PrefixMatcher) else None
