"""Rebalancing among control planes (`--peers`): a control plane that holds more than one worker
above its emptiest peer asks its newest worker to move (drain.py: it finishes what runs on it, then
gets Move and attaches elsewhere).

Every `--rebalance-interval` seconds, jittered by ±20% so that peers do not decide in lockstep, it
asks every peer's census (census.py), recognises itself by its control_plane_id, and compares
itself with its targets: the peers that accept workers and would take the worker it would move.
The census request carries that worker's hello and a peer says whether it would refuse it for good
(a peer too old to say is a target only when it serves the same model already: an empty one may
refuse every worker, and it would look emptiest for ever). One move at a time; after a move
completes it waits one more interval before deciding again: the moved worker needs about that long
to attach elsewhere and be counted there, and deciding at once would move a second worker for the
same imbalance.

A move must land: the next census of the peers it went toward (the emptiest) must count more
workers than before. When none counts more, the worker went elsewhere or came back (such a peer
says it takes workers and does not), and those peers are no targets for HOLD_OFF_INTERVALS
intervals, twice that after a second miss in a row, and so on up to MAX_HOLD_OFF_S: a move drains
a worker, and a peer whose moves do not land would otherwise be moved to every other interval.
The rules are fleet/rebalance.py's; this module runs them on the event loop.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence

import structlog

from control_plane.core.census import PeerCensus
from control_plane.core.drain import Departure
from control_plane.core.engine import Engine
from control_plane.core.fleet import Router
from control_plane.core.fleet.rebalance import HoldOff, Move, jittered, should_move, targets
from protos.worker import Census

log = structlog.get_logger("stepwise.rebalance")

# A peer whose move did not land is no target for this many intervals (doubling per further miss).
HOLD_OFF_INTERVALS = 30


class Rebalancer:
    """Decides once per interval; `turn` is one decision (tests call it directly)."""

    def __init__(
        self,
        interval_s: float,
        peers: PeerCensus,
        own: Callable[[], Census],
        router: Router[Engine],
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.peers = peers
        self.own = own
        self.router = router
        self.rng = rng or random.Random()
        # The move under way, until the engine's session has ended.
        self.moving: Move | None = None
        # The move that ended, until the next census says whether it landed.
        self.landing: Move | None = None
        self.hold_off = HoldOff(HOLD_OFF_INTERVALS * interval_s, clock)

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
            if self.router.engines.get(self.moving.engine.worker) is self.moving.engine:
                return None  # still leaving
            self.landing, self.moving = self.moving, None
            return None  # moved: one more interval before the next decision
        if not self.own().accepting:
            return None  # this control plane drains: every worker moves anyway
        engine = self._newest()
        replies = await self.peers.poll(engine.limits if engine is not None else None)
        self._judge_landing(replies)
        me = self.own()  # after the round trip: the counts to compare are the newest
        if not me.accepting or engine is None or engine not in self.router.available():
            return None
        peers = [p for p in targets(me, replies) if not self.hold_off.held(p.control_plane_id)]
        counts = {peer.control_plane_id[:8]: peer.workers for peer in peers}
        if not should_move(me.workers, list(counts.values())):
            log.debug("rebalance: no move", mine=me.workers, peers=counts)
            return None
        fewest = min(counts.values())
        log.info("rebalance: moving a worker", mine=me.workers, peers=counts, worker=engine.worker)
        engine.leave(
            Departure.MOVE,
            f"rebalancing: this control plane holds {me.workers} workers and a peer {fewest}",
        )
        toward = {p.control_plane_id: p.workers for p in peers if p.workers == fewest}
        self.moving = Move(engine, toward)
        return engine

    def _judge_landing(self, replies: Sequence[Census]) -> None:
        move, self.landing = self.landing, None
        if move is None:
            return
        landed = move.landed(replies)
        if landed is None:
            return  # none of them answered: nothing to judge by
        if landed:
            self.hold_off.landed(move.toward)
            return
        for peer in move.toward:
            seconds = self.hold_off.missed(peer)
            log.warning(
                "rebalance: a move did not land; the peer is no target for now",
                peer=peer[:8],
                worker=move.engine.worker,
                hold_off_s=round(seconds, 1),
            )

    def _newest(self) -> Engine | None:
        return max(self.router.available(), key=lambda e: e.attached_at, default=None)
