"""The rules of rebalancing among control planes (core/rebalance.py runs them every interval): whether
to give up a worker, which peers may take it, whether a move landed, and how long a peer whose move
did not land is no target. Plain values; the clock is passed in."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from control_plane.core.fleet.member import Member
from protos.worker import Census

JITTER = 0.2
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

    engine: Member
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
