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
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import structlog

from control_plane.core.census import PeerCensus
from control_plane.core.drain import Departure
from control_plane.core.engine import Engine
from control_plane.core.router import Router
from protos.worker import Census

log = structlog.get_logger("stepwise.rebalance")

JITTER = 0.2
# A peer whose move did not land is no target for this many intervals (doubling per further miss).
HOLD_OFF_INTERVALS = 30
MAX_HOLD_OFF_S = 600.0


def should_move(mine: int, peers: Sequence[int]) -> bool:
    """Whether a control plane with `mine` workers gives one up, given its peers' counts: only when
    it holds more than one above the emptiest (one above is as even as an odd total gets)."""
    return bool(peers) and mine > min(peers) + 1


def targets(me: Census, replies: Iterable[Census]) -> list[Census]:
    """The peers a worker could move to: not this control plane, accepting, and known to take the
    worker (see `takes`)."""
    return [
        peer
        for peer in replies
        if peer.control_plane_id != me.control_plane_id and peer.accepting and takes(me, peer)
    ]


def takes(me: Census, peer: Census) -> bool:
    """Whether `peer` would take the worker its census was asked about: as it says, or, when it
    could not judge the worker, when it serves this control plane's model already."""
    if peer.hello_judged:
        return not peer.refusal
    return bool(peer.model_fingerprint) and peer.model_fingerprint == me.model_fingerprint


def jittered(interval_s: float, rng: random.Random) -> float:
    return interval_s * rng.uniform(1 - JITTER, 1 + JITTER)


@dataclass(frozen=True, slots=True)
class Move:
    """A move decided: the engine asked to leave, and the peers it went toward (the emptiest
    targets) with their worker counts then."""

    engine: Engine
    toward: dict[str, int]

    def landed(self, replies: Iterable[Census]) -> bool | None:
        """Whether a peer it went toward now counts more workers; None when none of them answered."""
        now = {c.control_plane_id: c.workers for c in replies if c.control_plane_id in self.toward}
        if not now:
            return None
        return any(workers > self.toward[cp] for cp, workers in now.items())


class HoldOff:
    """The peers whose moves did not land, until when (`clock` seconds) they are no targets."""

    def __init__(self, first_s: float, clock: Callable[[], float]) -> None:
        self.first_s = first_s
        self.clock = clock
        self._until: dict[str, float] = {}
        self._misses: dict[str, int] = {}

    def missed(self, peer: str) -> float:
        """A move toward `peer` did not land: hold it off (longer each miss in a row); for how long."""
        misses = self._misses[peer] = self._misses.get(peer, 0) + 1
        seconds = min(self.first_s * 2 ** (misses - 1), MAX_HOLD_OFF_S)
        self._until[peer] = self.clock() + seconds
        return seconds

    def landed(self, peers: Iterable[str]) -> None:
        for peer in peers:
            self._misses.pop(peer, None)
            self._until.pop(peer, None)

    def held(self, peer: str) -> bool:
        return self._until.get(peer, float("-inf")) > self.clock()


class Rebalancer:
    """Decides once per interval; `turn` is one decision (tests call it directly)."""

    def __init__(
        self,
        interval_s: float,
        peers: PeerCensus,
        own: Callable[[], Census],
        router: Router,
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
