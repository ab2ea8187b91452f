"""Each waiting request's cached prefix, kept up to date as the tree and the queue change
(docs/scheduler.md#kept-matches).

SGLang matches every waiting request against the tree on every cache-aware pass, and so gives up on
cache-aware order past 128 waiting requests. The tree tells this object of every change to its shape
(RadixCache.listener), and a request's match can only change when the tree changes along its path:

* a new leaf where its match stops (at a node it covers whole, under the page it would follow next)
  may lengthen it;
* a split of, or the eviction of, the node its match ends in may move or shorten it.

So each kept match is indexed by the node it ends in and, when it covers that node whole, by the
(node, next page) a new leaf would have to hang at. A change marks the requests indexed there stale,
and the next `sync` re-matches only those (with `RadixCache.peek`: no split, no access time). The
queue tells it of arrivals and departures (Intake's watcher), so a pass costs nothing per waiting
request that did not change.

The in-batch dedup is kept too: requests whose match is at most `check` tokens are grouped by their
first `deprioritize` tokens; the earliest queue entry of a group is its representative, the others
are deprioritized. Each request's LPM sort key (`Request.queue_key`: +inf when deprioritized, else
−num_matched_prefix_tokens) is rewritten only when its match or its group changes.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Hashable, Sequence

from control_plane.cache.radix import RadixCache
from control_plane.cache.tree_node import TreeNode
from control_plane.request import Request

INF = float("inf")


class KeptMatch:
    """One waiting request's match as of its last (re-)match."""

    __slots__ = ("edge", "entry", "gone", "grouped", "head", "node", "req", "seqlen", "stale", "tokens")

    def __init__(self, req: Request, head_len: int) -> None:
        self.req = req
        self.entry = req.wait_queue_entry_time
        self.seqlen = req.seqlen
        self.tokens = 0  # page-aligned tokens of fill_ids[:seqlen] the tree holds
        self.node: TreeNode | None = None
        self.edge: tuple[TreeNode, Hashable] | None = None
        self.stale = True
        self.gone = False  # left the queue: never matched again
        self.grouped = False  # in its dedup group
        # The first `head_len` tokens (None when shorter): the in-batch dedup's key.
        fill = req.fill_ids
        self.head = fill[:head_len].tobytes() if len(fill) >= head_len else None

    def order_key(self) -> tuple[int, int]:
        return (self.entry, id(self))


class QueueMatches:
    """The kept matches of the waiting queue for one tree (its only listener) and one queue (its
    watcher)."""

    def __init__(self, tree: RadixCache, check: int, deprioritize: int) -> None:
        if tree.listener is not None:
            raise ValueError("the tree already has a listener")
        tree.listener = self
        self.tree = tree
        self.check = check
        self.deprioritize = deprioritize
        self.head_len = max(deprioritize, 0)
        self._kept: dict[int, KeptMatch] = {}
        self._by_node: dict[TreeNode, set[KeptMatch]] = {}
        self._by_edge: dict[tuple[TreeNode, Hashable], set[KeptMatch]] = {}
        self._groups: dict[bytes, list[KeptMatch]] = {}
        self._stale: list[KeptMatch] = []
        # Matches made (arrivals and stale requests), and full resyncs, for tests and the bench.
        self.rematches = 0
        self.resyncs = 0

    # --- the queue ---------------------------------------------------------------------------------

    def joined(self, req: Request) -> None:
        """`req` entered the waiting queue (a re-entry is a new request here)."""
        old = self._kept.pop(id(req), None)
        if old is not None:
            self._forget(old)
        k = self._kept[id(req)] = KeptMatch(req, self.head_len)
        self._stale.append(k)
        if len(self._stale) > 2 * len(self._kept) + 64:
            # No deep pass has synced for a while (a shallow queue): drop the departed, so the list
            # stays within a constant factor of the queue (amortised O(1) per arrival).
            self._stale = [s for s in self._stale if s.stale and not s.gone]

    def left(self, req: Request) -> None:
        k = self._kept.get(id(req))
        if k is not None and k.req is req:
            del self._kept[id(req)]
            self._forget(k)

    def sync(self, queue: Sequence[Request]) -> None:
        """Bring every kept match of `queue` up to date: re-match the stale ones and rewrite their
        sort keys. Costs O(changes) when the queue told of every arrival and departure; a queue
        whose length disagrees is resynced in full (O(queue))."""
        if len(queue) != len(self._kept):
            self._resync(queue)
        stale, self._stale = self._stale, []
        for k in stale:
            if k.stale and not k.gone:
                self._match(k)

    def kept(self, queue: Sequence[Request]) -> list[KeptMatch]:
        """The kept matches of `queue`, in its order, after `sync` (for tests)."""
        self.sync(queue)
        return [self._kept[id(req)] for req in queue]

    def _resync(self, queue: Sequence[Request]) -> None:
        self.resyncs += 1
        old, self._kept = self._kept, {}
        for req in queue:
            k = old.pop(id(req), None)
            if k is not None and k.req is req and k.entry == req.wait_queue_entry_time:
                self._kept[id(req)] = k
            else:
                if k is not None:
                    self._forget(k)
                self.joined(req)
        for k in old.values():
            self._forget(k)

    def _forget(self, k: KeptMatch) -> None:
        self._unlink(k)
        self._ungroup(k)
        k.gone = True

    # --- matching ----------------------------------------------------------------------------------

    def _match(self, k: KeptMatch) -> None:
        req = k.req
        tokens = req.fill_ids[: k.seqlen].tobytes()
        found = self.tree.peek(tokens)
        k.tokens, k.node, k.stale = found.tokens, found.node, False
        self._by_node.setdefault(found.node, set()).add(k)
        edge = self.tree.edge_at(tokens, found.tokens) if found.whole else None
        if edge is not None:
            k.edge = (found.node, edge)
            self._by_edge.setdefault(k.edge, set()).add(k)
        req.num_matched_prefix_tokens = min(found.tokens, max(k.seqlen - 1, 0))
        self.rematches += 1
        if self.check >= 0 and k.tokens <= self.check and k.head is not None:
            self._group(k)
        else:
            self._ungroup(k)
        self._rekey(k)

    def _unlink(self, k: KeptMatch) -> None:
        if k.node is not None:
            _discard(self._by_node, k.node, k)
            k.node = None
        if k.edge is not None:
            _discard(self._by_edge, k.edge, k)
            k.edge = None

    # --- the in-batch dedup ------------------------------------------------------------------------

    def _group(self, k: KeptMatch) -> None:
        if k.grouped:
            return
        assert k.head is not None
        group = self._groups.setdefault(k.head, [])
        first = group[0] if group else None
        insort(group, k, key=KeptMatch.order_key)
        k.grouped = True
        if first is not None and group[0] is not first:
            self._rekey(first)

    def _ungroup(self, k: KeptMatch) -> None:
        if not k.grouped:
            return
        assert k.head is not None
        group = self._groups[k.head]
        was_first = group[0] is k
        group.remove(k)
        k.grouped = False
        if not group:
            del self._groups[k.head]
        elif was_first:
            self._rekey(group[0])

    def _deprioritized(self, k: KeptMatch) -> bool:
        if self.check < 0 or k.tokens > self.check:
            return False
        if self.deprioritize <= 0:
            return True  # every match reaches 0 tokens (SGLang's simulated tree agrees)
        return k.grouped and self._groups[k.head][0] is not k  # type: ignore[index]

    def _rekey(self, k: KeptMatch) -> None:
        if not k.stale and not k.gone:
            k.req.queue_key = INF if self._deprioritized(k) else -k.req.num_matched_prefix_tokens

    def deprioritized(self, queue: Sequence[Request]) -> set[str]:
        """The rids the dedup defers, after `sync`."""
        return {r.rid for r in queue if r.queue_key == INF}

    # --- TreeListener ------------------------------------------------------------------------------

    def on_split(self, lower: TreeNode) -> None:
        self._mark(self._by_node.get(lower))

    def on_new_child(self, parent: TreeNode, edge: Hashable) -> None:
        self._mark(self._by_edge.get((parent, edge)))

    def on_removed(self, leaf: TreeNode) -> None:
        self._mark(self._by_node.get(leaf))

    def on_reset(self) -> None:
        self._by_node.clear()
        self._by_edge.clear()
        for k in self._kept.values():
            k.node = k.edge = None
            self._set_stale(k)

    def _mark(self, matches: set[KeptMatch] | None) -> None:
        for k in list(matches or ()):
            self._unlink(k)
            self._set_stale(k)

    def _set_stale(self, k: KeptMatch) -> None:
        if not k.stale:
            k.stale = True
            self._stale.append(k)


def _discard(index: dict, key: object, k: KeptMatch) -> None:  # type: ignore[type-arg]
    entries = index.get(key)
    if entries is not None:
        entries.discard(k)
        if not entries:
            del index[key]
