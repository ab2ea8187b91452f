"""Rebalancing among control planes (control_plane/core/rebalance.py): the decision as a pure function,
the peers it compares with, and one Rebalancer over engines attached to a real router."""

from __future__ import annotations

import asyncio
import random

import pytest

from control_plane.core.census import Census
from control_plane.core.drain import Departure
from control_plane.core.engine import Engine
from control_plane.core.rebalance import JITTER, Rebalancer, comparable, jittered, should_move
from control_plane.core.router import Router
from tests.control_plane.fake_core import FakeHub, make_engine

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("mine", "peers", "move"),
    [
        (3, [0], True),
        (2, [0], True),
        (2, [1], False),  # one above is as even as it gets
        (1, [0], False),
        (0, [0], False),
        (5, [3, 4], True),
        (5, [4, 9], False),
        (4, [2, 2, 8], True),  # the emptiest peer decides
        (9, [], False),  # no peers: nothing to compare with
    ],
)
def test_should_move(mine: int, peers: list[int], move: bool) -> None:
    assert should_move(mine, peers) is move


def _census(cp: str, workers: int, accepting: bool = True, fingerprint: str = "") -> Census:
    return Census(cp, workers, 0, 0, accepting, fingerprint)


def test_comparable_peers_leave_out_itself_the_draining_and_other_models() -> None:
    me = _census("me", 3, fingerprint="m1")
    replies = [
        me,
        _census("same-model", 1, fingerprint="m1"),
        _census("empty", 0),
        _census("draining", 0, accepting=False),
        _census("other-model", 0, fingerprint="m2"),
    ]
    assert [c.control_plane_id for c in comparable(me, replies)] == ["same-model", "empty"]
    # Without workers of its own, any model is comparable.
    assert [c.control_plane_id for c in comparable(_census("me", 0), replies)] == [
        "same-model",
        "empty",
        "other-model",
    ]


def test_intervals_are_jittered_by_twenty_percent() -> None:
    rng = random.Random(7)
    waits = [jittered(2.0, rng) for _ in range(200)]
    assert all(2.0 * (1 - JITTER) <= w <= 2.0 * (1 + JITTER) for w in waits)
    assert max(waits) - min(waits) > 0.5  # not a constant


class _Peers:
    """A PeerCensus stand-in: the census a round of polling returns."""

    def __init__(self) -> None:
        self.replies: list[Census] = []
        self.polls = 0

    async def poll(self) -> list[Census]:
        self.polls += 1
        return list(self.replies)

    async def close(self) -> None:
        pass


def _attach(router: Router, hub: FakeHub, worker: str) -> Engine:
    engine, _, _ = make_engine(1000, worker_id=worker, hub=hub)
    router.attach(engine)
    return engine


def _own(router: Router) -> Census:
    return Census("me", len(router.available()), 0, 0, True, "")


async def test_the_newest_worker_moves_one_at_a_time_until_the_spread_is_even() -> None:
    router, hub, peers = Router("test"), FakeHub(), _Peers()
    engines = []
    for worker in ("w0", "w1", "w2"):
        engines.append(_attach(router, hub, worker))
        await asyncio.sleep(0.001)  # distinct attach times
    rebalancer = Rebalancer(1.0, peers, lambda: _own(router), router)  # type: ignore[arg-type]
    peers.replies = [_census("me", 3), _census("peer", 0)]
    moved = await rebalancer.turn()
    assert moved is engines[2] and moved.leaving is not None
    assert moved.leaving.departure is Departure.MOVE
    assert "holds 3 workers and a peer 0" in moved.leaving.reason
    # While it is leaving: no decision, not even a look at the peers.
    polls = peers.polls
    assert await rebalancer.turn() is None and peers.polls == polls
    router.detach(moved)  # its session ended; it attaches to the peer
    peers.replies = [_census("me", 2), _census("peer", 1)]
    assert await rebalancer.turn() is None and peers.polls == polls  # one more interval first
    assert await rebalancer.turn() is None and peers.polls == polls + 1  # 2 vs 1: even
    assert all(e.leaving is None for e in engines[:2])


async def test_no_move_while_this_control_plane_drains() -> None:
    router, hub, peers = Router("test"), FakeHub(), _Peers()
    for worker in ("w0", "w1", "w2"):
        _attach(router, hub, worker)
    peers.replies = [_census("peer", 0)]
    draining = Census("me", 3, 0, 0, False, "")
    rebalancer = Rebalancer(1.0, peers, lambda: draining, router)  # type: ignore[arg-type]
    assert await rebalancer.turn() is None
    assert all(e.leaving is None for e in router.engines.values())
    assert peers.polls == 0  # not even a look at the peers
