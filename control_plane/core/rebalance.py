"""Rebalancing among control planes (`--peers`): a control plane that holds more than one worker
above its emptiest peer asks its newest worker to move (drain.py: it finishes what runs on it, then
gets Move and attaches elsewhere).

Every `--rebalance-interval` seconds, jittered by ±20% so that peers do not decide in lockstep, it
asks every peer's census (census.py), recognises itself by its control_plane_id, and compares
itself with the peers that accept workers and serve the same model (or none yet). One move at a
time; after a move completes it waits one more interval before deciding again: the moved worker
needs about that long to attach elsewhere and be counted there, and deciding at once would move a
second worker for the same imbalance.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable, Sequence

import structlog

from control_plane.core.census import PeerCensus
from control_plane.core.drain import Departure
from control_plane.core.engine import Engine
from control_plane.core.router import Router
from protos.worker import Census

log = structlog.get_logger("stepwise.rebalance")

JITTER = 0.2


def should_move(mine: int, peers: Sequence[int]) -> bool:
    """Whether a control plane with `mine` workers gives one up, given its peers' counts: only when
    it holds more than one above the emptiest (one above is as even as an odd total gets)."""
    return bool(peers) and mine > min(peers) + 1


def comparable(me: Census, replies: Iterable[Census]) -> list[Census]:
    """The peers a worker could move to: not this control plane, accepting, and serving the same
    model (a peer without workers serves any)."""
    return [
        peer
        for peer in replies
        if peer.control_plane_id != me.control_plane_id
        and peer.accepting
        and (
            not peer.model_fingerprint
            or not me.model_fingerprint
            or peer.model_fingerprint == me.model_fingerprint
        )
    ]


def jittered(interval_s: float, rng: random.Random) -> float:
    return interval_s * rng.uniform(1 - JITTER, 1 + JITTER)


class Rebalancer:
    """Decides once per interval; `turn` is one decision (tests call it directly)."""

    def __init__(
        self,
        interval_s: float,
        peers: PeerCensus,
        own: Callable[[], Census],
        router: Router,
        rng: random.Random | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.peers = peers
        self.own = own
        self.router = router
        self.rng = rng or random.Random()
        # The engine asked to move, until its session has ended.
        self.moving: Engine | None = None

    async def run(self) -> None:
        """Decide every interval until cancelled; a failed round is logged and the next one comes."""
        try:
            while True:
                await asyncio.sleep(jittered(self.interval_s, self.rng))
                try:
                    await self.turn()
                except Exception:
                    log.exception("rebalancing round failed")
        finally:
            await self.peers.close()

    async def turn(self) -> Engine | None:
        """One decision: the engine asked to move now, or None."""
        if self.moving is not None:
            if self.router.engines.get(self.moving.worker) is self.moving:
                return None  # still leaving
            self.moving = None
            return None  # moved: one more interval before the next decision
        if not self.own().accepting:
            return None  # this control plane drains: every worker moves anyway
        replies = await self.peers.poll()
        me = self.own()  # after the round trip: the counts to compare are the newest
        if not me.accepting:
            return None
        peers = comparable(me, replies)
        counts = {peer.control_plane_id[:8]: peer.workers for peer in peers}
        if not should_move(me.workers, list(counts.values())):
            log.debug("rebalance: no move", mine=me.workers, peers=counts)
            return None
        engine = self._newest()
        if engine is None:
            return None
        fewest = min(counts.values())
        log.info("rebalance: moving a worker", mine=me.workers, peers=counts, worker=engine.worker)
        engine.leave(
            Departure.MOVE,
            f"rebalancing: this control plane holds {me.workers} workers and a peer {fewest}",
        )
        self.moving = engine
        return engine

    def _newest(self) -> Engine | None:
        return max(self.router.available(), key=lambda e: e.attached_at, default=None)
