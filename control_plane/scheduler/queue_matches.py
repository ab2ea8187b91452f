"""Each waiting request's cached prefix, kept up to date as the tree changes
(docs/scheduler.md#kept-matches).

SGLang matches every waiting request against the tree on every cache-aware pass, and so gives up on
cache-aware order past 128 waiting requests. The tree tells this object of every change to its shape
(RadixCache.listener), and a request's match can only change when the tree changes along its path:

* a new leaf where its match stops (at a node it covers whole, under the page it would follow next)
  may lengthen it;
* a split of, or the eviction of, the node its match ends in may move or shorten it.

So each kept match is indexed by the node it ends in and, when it covers that node whole, by the
(node, next page) a new leaf would have to hang at. A change marks the requests indexed there stale,
and the next `refresh` re-matches only those (with `RadixCache.peek`: no split, no access time).
Requests that joined the queue since the last refresh are matched once; those that left are
forgotten. A refresh costs a dict lookup per waiting request plus one match per stale request.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from control_plane.cache.radix import RadixCache
from control_plane.cache.tree_node import TreeNode
from control_plane.request import Request


class KeptMatch:
    """One waiting request's match as of its last (re-)match."""

    __slots__ = ("edge", "head", "node", "req", "seen", "seqlen", "stale", "tokens")

    def __init__(self, req: Request, head_len: int) -> None:
        self.req = req
        self.seqlen = req.seqlen
        self.tokens = 0  # page-aligned tokens of fill_ids[:seqlen] the tree holds
        self.node: TreeNode | None = None
        self.edge: tuple[TreeNode, Hashable] | None = None
        self.stale = True
        self.seen = 0
        # The first `head_len` prompt tokens (None when shorter): the in-batch dedup's key.
        fill = req.fill_ids
        self.head = fill[:head_len].tobytes() if len(fill) >= head_len else None


class QueueMatches:
    """The kept matches of the waiting queue for one tree (its only listener)."""

    def __init__(self, tree: RadixCache, head_len: int) -> None:
        if tree.listener is not None:
            raise ValueError("the tree already has a listener")
        tree.listener = self
        self.tree = tree
        self.head_len = head_len
        self._kept: dict[int, KeptMatch] = {}
        self._by_node: dict[TreeNode, set[KeptMatch]] = {}
        self._by_edge: dict[tuple[TreeNode, Hashable], set[KeptMatch]] = {}
        self._stale: list[KeptMatch] = []
        self._pass = 0
        # Matches made (new or stale requests), for tests and the bench.
        self.rematches = 0

    def refresh(self, queue: Sequence[Request]) -> list[KeptMatch]:
        """Bring the kept match of every request in `queue` up to date and return them in queue
        order. Sets each re-matched request's num_matched_prefix_tokens (as a full match would);
        touches nothing in the tree."""
        self._pass = stamp = self._pass + 1
        kept = self._kept
        out: list[KeptMatch] = []
        append = out.append
        for req in queue:
            k = kept.get(id(req))
            if k is None or k.req is not req or k.seqlen != req.seqlen:
                if k is not None:
                    self._unlink(k)
                k = kept[id(req)] = KeptMatch(req, self.head_len)
                self._stale.append(k)
            k.seen = stamp
            append(k)
        if len(kept) > len(out):
            for key in [key for key, k in kept.items() if k.seen != stamp]:
                self._unlink(kept.pop(key))
        for k in self._stale:
            if k.stale and k.seen == stamp:
                self._match(k)
        self._stale = []
        return out

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

    def _unlink(self, k: KeptMatch) -> None:
        if k.node is not None:
            _discard(self._by_node, k.node, k)
            k.node = None
        if k.edge is not None:
            _discard(self._by_edge, k.edge, k)
            k.edge = None

    def _mark(self, matches: set[KeptMatch] | None) -> None:
        for k in list(matches or ()):
            self._unlink(k)
            if not k.stale:
                k.stale = True
                self._stale.append(k)

    # --- TreeListener ------------------------------------------------------------------------------

    def on_split(self, lower: TreeNode) -> None:
        self._mark(self._by_node.get(lower))

    def on_new_child(self, parent: TreeNode, edge: Hashable) -> None:
        self._mark(self._by_edge.get((parent, edge)))

    def on_removed(self, leaf: TreeNode) -> None:
        self._mark(self._by_node.get(leaf))

    def on_reset(self) -> None:
        for k in self._kept.values():
            k.node = k.edge = None
            if not k.stale:
                k.stale = True
                self._stale.append(k)
        self._by_node.clear()
        self._by_edge.clear()


def _discard(index: dict, key: object, k: KeptMatch) -> None:  # type: ignore[type-arg]
    entries = index.get(key)
    if entries is not None:
        entries.discard(k)
        if not entries:
            del index[key]
