"""Waiting-queue ordering policies (docs/scheduler.md#ordering-policies), one small class each, chosen by
name.

`order(queue, running)` reorders the waiting queue in place, once per prefill attempt. Cache-aware
policies (lpm, dfs-weight) match every waiting request against the prefix tree, which also sets
the request's `prefix_indices` and `last_node`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from control_plane.cache.radix import RadixCache
from control_plane.config import SchedulerConfig
from control_plane.request import Request
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.priority import priority_sign, urgency

# Past this many waiting requests LPM falls back to FCFS for the pass (per-request matching cost).
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

    def __init__(self, kv: KvManager, config: SchedulerConfig) -> None:
        self.kv = kv
        self.check_threshold = config.in_batch_prefix_check_threshold
        self.deprioritize_threshold = config.in_batch_prefix_deprioritize_threshold

    def match_all(self, queue: Sequence[Request]) -> set[str]:
        """Mutates each request's prefix fields; returns the rids to deprioritize."""
        deprioritized: set[str] = set()
        sim = _simulated_tree() if self.check_threshold >= 0 else None
        for req in queue:
            self.kv.match_prefix(req, req.seqlen)
            req.num_matched_prefix_tokens = min(len(req.prefix_indices), max(req.seqlen - 1, 0))
            if sim is None or len(req.prefix_indices) > self.check_threshold:
                continue
            fill = req.fill_ids
            if len(sim.match_prefix(fill).indices) >= self.deprioritize_threshold:
                deprioritized.add(req.rid)
            else:
                sim.insert(fill)
        return deprioritized


def _simulated_tree() -> RadixCache:
    # No pool behind it: it only answers "how long is the prefix shared with an earlier request".
    return RadixCache(None, page_size=1)


class LongestPrefixMatch:
    cache_aware = True

    def __init__(self, config: SchedulerConfig, matcher: PrefixMatcher) -> None:
        self.matcher = matcher

    def order(self, queue: list[Request], running: Sequence[Request]) -> None:
        if len(queue) > LPM_FALLBACK_QUEUE_LEN:
            return  # FCFS for this pass
        deprioritized = self.matcher.match_all(queue)
        inf = float("inf")
        queue.sort(key=lambda r: inf if r.rid in deprioritized else -r.num_matched_prefix_tokens)


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


PolicyFactory = Callable[[SchedulerConfig, KvManager], Policy]

POLICIES: dict[str, PolicyFactory] = {
    "fcfs": lambda config, kv: Fcfs(config),
    "lof": lambda config, kv: LongestOutputFirst(config),
    "random": lambda config, kv: RandomOrder(config),
    "routing-key": lambda config, kv: RoutingKey(config),
    "lpm": lambda config, kv: LongestPrefixMatch(config, PrefixMatcher(kv, config)),
    "dfs-weight": lambda config, kv: DfsWeight(config, PrefixMatcher(kv, config)),
}


def make_policy(config: SchedulerConfig, kv: KvManager) -> Policy:
    """The configured policy; a cache-aware one becomes FCFS when the prefix cache is off
    (docs/scheduler.md#ordering-policies)."""
    try:
        factory = POLICIES[config.schedule_policy]
    except KeyError:
        raise ValueError(f"Unknown schedule_policy: {config.schedule_policy!r}") from None
    policy = factory(config, kv)
    if policy.cache_aware and kv.disabled:
        return Fcfs(config)
    return policy
