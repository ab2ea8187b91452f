"""Placement (control_plane/core/fleet/placement.py) from plain values: which calls move and where,
for each reason, and the properties every plan keeps: no call in a plan twice or while it moves, no
move to a worker without room for it (or, through the fleet, of the wrong role), and a drain with
a candidate empties its worker."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.core.fleet import Call, Fleet, Router, Rules, Spill
from control_plane.core.fleet.balance import BALANCE, KV, Room
from control_plane.core.fleet.placement import Peer, balance, drain, one_at_random, to_decode
from tests.control_plane.fleet.members import FakeMember

RULES = Rules(steps=4, threshold=0.3)


def _call(name: str, tokens: int = 10, samples: int = 1, **flags: bool) -> Call:
    rids = (name,) if samples == 1 else tuple(f"{name}/{i}" for i in range(samples))
    return Call(rids, tokens, **flags)


# --- the prefill worker's hand-off ---------------------------------------------------------------


def test_a_ready_call_goes_to_the_least_loaded_decode_worker_with_room() -> None:
    decoders = [
        Peer("d0", "decode", Room(100, 1000, 0), load=3),
        Peer("d1", "decode", Room(100, 1000, 0), load=1),
    ]
    plan = to_decode([_call("a")], decoders, steps=4)
    assert [(m.rids, m.to, m.reason, m.precopy) for m in plan.moves] == [(("a",), "d1", "pd", False)]


def test_each_hand_off_counts_toward_its_target_so_a_burst_spreads() -> None:
    decoders = [Peer("d0", "decode", Room(1000, 1000, 0)), Peer("d1", "decode", Room(1000, 1000, 0))]
    plan = to_decode([_call(str(i)) for i in range(6)], decoders, steps=4)
    assert Counter(m.to for m in plan.moves) == {"d0": 3, "d1": 3}


def test_a_call_that_fits_nowhere_decodes_here_and_unready_calls_stay() -> None:
    decoders = [Peer("d0", "decode", Room(13, 1000, 0))]  # 10 tokens + 4 steps of growth = 14
    assert to_decode([_call("a")], decoders, steps=4).moves == ()
    calls = [_call("b", tokens=1, started=False), _call("c", tokens=1, movable=False)]
    assert to_decode(calls, decoders, steps=4).moves == ()


def test_ties_go_to_the_roomiest_then_the_smallest_id() -> None:
    decoders = [Peer("d1", "decode", Room(500, 1000, 0)), Peer("d0", "decode", Room(500, 1000, 0))]
    assert to_decode([_call("a")], decoders, 4).moves[0].to == "d0"
    decoders.append(Peer("d2", "decode", Room(900, 1000, 0)))
    assert to_decode([_call("a")], decoders, 4).moves[0].to == "d2"


# --- KV balance ------------------------------------------------------------------------------------


def test_a_worker_with_room_and_no_queue_leaves_the_spill_off() -> None:
    plan = balance(Room(10, 100, 0), [Peer("b", room=Room(90, 100, 0))], [_call("a")], RULES, False)
    assert plan.moves == () and plan.spill == Spill(None, 0)


def test_a_short_worker_spills_to_the_roomiest_and_moves_calls_until_the_shortfall_is_covered() -> None:
    here = Room(-20, 100, 0)
    peers = [Peer("b", room=Room(50, 100, 0)), Peer("c", room=Room(80, 100, 0))]
    calls = [_call("x", 8), _call("ends", 8, ends_soon=True), _call("y", 8), _call("z", 8)]
    plan = balance(here, peers, calls, RULES, underway=False)
    assert plan.spill == Spill("c", 80)
    # x: 8 + 4 of growth covers 12 of 20, y the rest; "ends" finishes within the look-ahead anyway.
    assert [(m.rids, m.to, m.reason) for m in plan.moves] == [(("x",), "c", KV), (("y",), "c", KV)]


def test_a_queue_beside_free_kv_moves_one_call() -> None:
    plan = balance(
        Room(10, 100, 3), [Peer("b", room=Room(90, 100, 0))], [_call("x", 5), _call("y", 5)], RULES, False
    )
    assert [(m.rids, m.reason) for m in plan.moves] == [(("x",), BALANCE)]
    assert plan.spill == Spill(None, 90)


def test_no_move_while_one_of_its_reasons_is_underway() -> None:
    plan = balance(Room(-20, 100, 0), [Peer("b", room=Room(80, 100, 0))], [_call("x")], RULES, underway=True)
    assert plan.moves == () and plan.spill == Spill("b", 80)


# --- drain and the test knob -----------------------------------------------------------------------


def test_a_drain_spreads_every_movable_call_over_the_least_loaded() -> None:
    calls = [_call("a"), _call("b", samples=2), _call("c", movable=False), _call("d")]
    plan = drain(calls, [Peer("x", load=0), Peer("y", load=1)])
    # a: x (0 < 1); b: x again (1 = 1, the smaller id), x now 3; d: y.
    assert [(m.rids, m.to) for m in plan.moves] == [(("a",), "x"), (("b/0", "b/1"), "x"), (("d",), "y")]


def test_the_test_knob_moves_one_ready_call_drawn_from_its_generator() -> None:
    calls = [_call("a"), _call("b"), _call("c", started=False)]
    first = one_at_random(calls, [Peer("x")], random.Random("w"))
    again = one_at_random(calls, [Peer("x")], random.Random("w"))
    assert first == again and len(first.moves) == 1 and first.moves[0].rids in {("a",), ("b",)}
    assert one_at_random(calls, [], random.Random("w")).moves == ()


# --- properties ----------------------------------------------------------------------------------

calls_st = st.lists(
    st.builds(
        Call,
        rids=st.just(()),
        tokens=st.integers(0, 300),
        movable=st.booleans(),
        started=st.booleans(),
        ends_soon=st.booleans(),
    ),
    max_size=12,
).map(
    lambda calls: [Call((f"r{i}",), c.tokens, c.movable, c.started, c.ends_soon) for i, c in enumerate(calls)]
)
peers_st = st.lists(
    st.builds(
        Peer,
        worker=st.just(""),
        room=st.builds(Room, st.integers(-100, 1000), st.just(1000), st.integers(0, 3)),
        load=st.integers(0, 20),
        once=st.booleans(),
    ),
    max_size=4,
).map(lambda peers: [Peer(f"p{i}", p.role, p.room, p.load, p.once) for i, p in enumerate(peers)])


def _check_common(calls: list[Call], peers: list[Peer], moves: tuple, ready_only: bool) -> None:
    by_rids = {c.rids: c for c in calls}
    moved = [m.rids for m in moves]
    assert len(moved) == len(set(moved)), "a call in one plan twice"
    for move in moves:
        call = by_rids[move.rids]
        assert call.movable, "a call that is moving already (or not running here) moved again"
        assert not ready_only or call.started
        assert move.to in {p.worker for p in peers}
    targets = Counter(m.to for m in moves)
    assert all(targets[p.worker] <= 1 for p in peers if p.once), "a worker on probation got two moves"


def _check_room(calls: list[Call], peers: list[Peer], moves: tuple, steps: int) -> None:
    """The moves to each worker fit in its headroom together with their look-ahead growth."""
    need: Counter[str] = Counter()
    tokens = {c.rids: c.tokens for c in calls}
    for move in moves:
        need[move.to] += tokens[move.rids] + steps * len(move.rids)
    for peer in peers:
        assert need[peer.worker] <= max(peer.room.headroom, 0)


@settings(max_examples=300, deadline=None)
@given(calls=calls_st, peers=peers_st)
def test_hand_offs_go_only_where_there_is_room(calls: list[Call], peers: list[Peer]) -> None:
    plan = to_decode(calls, peers, steps=4)
    _check_common(calls, peers, plan.moves, ready_only=True)
    _check_room(calls, peers, plan.moves, steps=4)


@settings(max_examples=300, deadline=None)
@given(
    calls=calls_st,
    peers=peers_st,
    here=st.builds(Room, st.integers(-500, 500), st.just(1000), st.integers(0, 3)),
    underway=st.booleans(),
)
def test_balance_moves_go_only_where_there_is_room(
    calls: list[Call], peers: list[Peer], here: Room, underway: bool
) -> None:
    plan = balance(here, peers, calls, RULES, underway)
    _check_common(calls, peers, plan.moves, ready_only=True)
    _check_room(calls, peers, plan.moves, steps=RULES.steps)
    assert not (underway and plan.moves)
    assert len({m.to for m in plan.moves}) <= 1
    assert all(not c.ends_soon for c in calls if c.rids in {m.rids for m in plan.moves})
    if plan.moves and plan.moves[0].reason == BALANCE:
        assert len(plan.moves) == 1


@settings(max_examples=300, deadline=None)
@given(calls=calls_st, peers=peers_st)
def test_a_drain_empties_its_worker(calls: list[Call], peers: list[Peer]) -> None:
    plan = drain(calls, peers)
    _check_common(calls, peers, plan.moves, ready_only=False)
    movable = [c.rids for c in calls if c.movable]
    if any(not p.once for p in peers):
        assert sorted(m.rids for m in plan.moves) == sorted(movable)
    else:
        assert len(plan.moves) == min(len(movable), len(peers))


# --- the fleet reads the members and keeps to roles and reachability -----------------------------

roles_st = st.lists(
    st.tuples(
        st.sampled_from(["mixed", "prefill", "decode"]), st.booleans(), st.booleans(), st.integers(-50, 500)
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=200, deadline=None)
@given(
    workers=roles_st,
    role=st.sampled_from(["mixed", "prefill", "decode"]),
    calls=calls_st,
    queued=st.integers(0, 2),
)
def test_the_fleet_moves_calls_only_to_serving_reachable_workers_of_the_right_role(
    workers: list[tuple[str, bool, bool, int]], role: str, calls: list[Call], queued: int
) -> None:
    router: Router[FakeMember] = Router("m")
    me = FakeMember("me", role, queued=queued, headroom=-100, live=calls)
    router.attach(me)
    for i, (r, serving, transfer, headroom) in enumerate(workers):
        router.attach(FakeMember(f"w{i}", r, serving=serving, transfer=transfer, headroom=headroom))
    fleet = Fleet(router)
    plan = fleet.place(me, RULES)
    for move in plan.moves:
        target = router.engines[move.to]
        assert target is not me and target.serving and target.transfer
        assert target.role == ("decode" if role == "prefill" else role)
    for move in fleet.drain(me).moves:
        target = router.engines[move.to]
        assert target is not me and target.serving and target.transfer


def test_calls_on_their_way_to_a_worker_count_in_its_load() -> None:
    """d0's copies from p hang (it never reports them): counted, d0 is no longer the least loaded."""
    router: Router[FakeMember] = Router("m")
    p = FakeMember("p", "prefill", live=[_call("new")], moving_to=Counter({"d0": 2}))
    for member in (p, FakeMember("d0", "decode"), FakeMember("d1", "decode", running=1)):
        router.attach(member)
    assert [m.to for m in Fleet(router).place(p, RULES).moves] == ["d1"]
    p.moving_to.clear()
    assert [m.to for m in Fleet(router).place(p, RULES).moves] == ["d0"]
