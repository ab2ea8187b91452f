"""Rebalancing among control planes (control_plane/core/rebalance.py, its rules in fleet/rebalance.py):
the decision as a pure function, the peers it compares with, and one Rebalancer over engines attached
to a real router."""

from __future__ import annotations

import asyncio
import random

import pytest

from control_plane.core.drain import Departure
from control_plane.core.engine import Engine
from control_plane.core.fleet import Router
from control_plane.core.fleet.rebalance import JITTER, jittered, should_move, targets
from control_plane.core.rebalance import HOLD_OFF_INTERVALS, Rebalancer
from protos.worker import Census, WorkerLimits
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


def _census(
    cp: str, workers: int, accepting: bool = True, fingerprint: str = "", refusal: str | None = None
) -> Census:
    """A peer's census; `refusal` set: it judged the hello asked about ("": it takes that worker)."""
    judged = refusal is not None
    return Census(cp, workers, 0, 0, accepting, fingerprint, hello_judged=judged, refusal=refusal or "")


def test_targets_leave_out_itself_the_draining_and_those_that_refuse_the_worker() -> None:
    me = _census("me", 3, fingerprint="m1")
    replies = [
        me,
        _census("takes-it", 0, refusal=""),
        _census("same-model", 1, fingerprint="m1", refusal=""),
        _census("refuses", 0, refusal="page_size 1 differs from the control plane's --page-size 16"),
        _census("other-model", 0, fingerprint="m2", refusal="model_fingerprint differs"),
        _census("draining", 0, accepting=False, refusal=""),
    ]
    assert [c.control_plane_id for c in targets(me, replies)] == ["takes-it", "same-model"]


def test_a_peer_that_cannot_judge_the_worker_is_a_target_only_when_it_serves_the_same_model() -> None:
    """An older peer does not say whether it would take the worker: only one already serving this
    model has shown that it takes such workers. An empty one may refuse every worker and would look
    emptiest for ever."""
    me = _census("me", 3, fingerprint="m1")
    replies = [
        _census("old-same", 1, fingerprint="m1"),
        _census("old-empty", 0),
        _census("old-other", 0, "m2"),
    ]
    assert [c.control_plane_id for c in targets(me, replies)] == ["old-same"]
    assert targets(_census("me", 0), replies) == []  # nothing of its own to compare


def test_intervals_are_jittered_by_twenty_percent() -> None:
    rng = random.Random(7)
    waits = [jittered(2.0, rng) for _ in range(200)]
    assert all(2.0 * (1 - JITTER) <= w <= 2.0 * (1 + JITTER) for w in waits)
    assert max(waits) - min(waits) > 0.5  # not a constant


class _Peers:
    """A PeerCensus stand-in: the census a round of polling returns, and the hellos asked about."""

    def __init__(self) -> None:
        self.replies: list[Census] = []
        self.polls = 0
        self.asked: list[WorkerLimits | None] = []

    async def poll(self, hello: WorkerLimits | None = None) -> list[Census]:
        self.polls += 1
        self.asked.append(hello)
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
    peers.replies = [_census("me", 3), _census("peer", 0, refusal="")]
    moved = await rebalancer.turn()
    assert moved is engines[2] and moved.leaving is not None
    assert peers.asked == [engines[2].limits]  # would the peer take the worker to move?
    assert moved.leaving.departure is Departure.MOVE
    assert "holds 3 workers and a peer 0" in moved.leaving.reason
    # While it is leaving: no decision, not even a look at the peers.
    polls = peers.polls
    assert await rebalancer.turn() is None and peers.polls == polls
    router.detach(moved)  # its session ended; it attaches to the peer
    peers.replies = [_census("me", 2), _census("peer", 1, refusal="")]
    assert await rebalancer.turn() is None and peers.polls == polls  # one more interval first
    assert await rebalancer.turn() is None and peers.polls == polls + 1  # 2 vs 1: even
    assert all(e.leaving is None for e in engines[:2])


async def test_no_move_while_this_control_plane_drains() -> None:
    router, hub, peers = Router("test"), FakeHub(), _Peers()
    for worker in ("w0", "w1", "w2"):
        _attach(router, hub, worker)
    peers.replies = [_census("peer", 0, refusal="")]
    draining = Census("me", 3, 0, 0, False, "")
    rebalancer = Rebalancer(1.0, peers, lambda: draining, router)  # type: ignore[arg-type]
    assert await rebalancer.turn() is None
    assert all(e.leaving is None for e in router.engines.values())
    assert peers.polls == 0  # not even a look at the peers


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _moved_and_back(rebalancer: Rebalancer, router: Router, hub: FakeHub, peers: _Peers) -> Engine:
    """One move decided, the worker's session ended, and the worker attached here again (the peer
    refused it); then the turn that only notices the move ended."""
    moved = await rebalancer.turn()
    assert moved is not None
    router.detach(moved)
    _attach(router, hub, moved.worker)
    polls = peers.polls
    assert await rebalancer.turn() is None and peers.polls == polls
    return moved


async def test_a_peer_whose_moves_do_not_land_is_no_target_for_a_while_longer_each_time() -> None:
    """The peer says it takes workers, but the moved worker never shows up in its census (once: 15
    moves in 30 s to a peer that refused every one)."""
    router, hub, peers, clock = Router("test"), FakeHub(), _Peers(), _Clock()
    for worker in ("w0", "w1", "w2"):
        _attach(router, hub, worker)
    interval = 1.0
    rebalancer = Rebalancer(interval, peers, lambda: _own(router), router, clock=clock)  # type: ignore[arg-type]
    peers.replies = [_census("me", 3), _census("sink", 0, refusal="")]
    await _moved_and_back(rebalancer, router, hub, peers)
    # The sink still has no worker: the move did not land, and the sink is no target now.
    assert await rebalancer.turn() is None
    assert all(e.leaving is None for e in router.engines.values())
    hold_s = HOLD_OFF_INTERVALS * interval
    clock.now += hold_s - 0.1
    assert await rebalancer.turn() is None
    clock.now += 0.2
    await _moved_and_back(rebalancer, router, hub, peers)  # held off long enough: one more try
    assert await rebalancer.turn() is None  # missed again: held off twice as long
    clock.now += 2 * hold_s - 0.1
    assert await rebalancer.turn() is None
    clock.now += 0.2
    assert await rebalancer.turn() is not None


async def test_a_move_that_lands_holds_nothing_off() -> None:
    router, hub, peers, clock = Router("test"), FakeHub(), _Peers(), _Clock()
    for worker in ("w0", "w1", "w2", "w3"):
        _attach(router, hub, worker)
    rebalancer = Rebalancer(1.0, peers, lambda: _own(router), router, clock=clock)  # type: ignore[arg-type]
    peers.replies = [_census("me", 4), _census("peer", 0, refusal="")]
    moved = await rebalancer.turn()
    assert moved is not None
    router.detach(moved)
    assert await rebalancer.turn() is None
    peers.replies = [_census("me", 3), _census("peer", 1, refusal="")]  # it is there now
    assert await rebalancer.turn() is not None  # 3 against 1: the next move, at once


async def test_a_tie_for_the_emptiest_lands_on_either() -> None:
    """Workers break ties by load and address, which the census does not show: a move toward two
    equally empty peers lands when either grows, and only a peer that stayed empty is held off."""
    router, hub, peers, clock = Router("test"), FakeHub(), _Peers(), _Clock()
    for worker in ("w0", "w1", "w2"):
        _attach(router, hub, worker)
    rebalancer = Rebalancer(1.0, peers, lambda: _own(router), router, clock=clock)  # type: ignore[arg-type]
    peers.replies = [_census("me", 3), _census("b", 0, refusal=""), _census("c", 0, refusal="")]
    moved = await rebalancer.turn()
    assert moved is not None
    router.detach(moved)
    assert await rebalancer.turn() is None
    peers.replies = [_census("me", 2), _census("b", 0, refusal=""), _census("c", 1, refusal="")]
    # Landed on c; b is still a target (2 > 0 + 1). Were it held off, 2 against c's 1 is even.
    assert await rebalancer.turn() is not None
