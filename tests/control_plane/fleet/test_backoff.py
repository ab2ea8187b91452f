"""The back-off of destinations whose moves failed (control_plane/core/fleet/backoff.py), on a clock
the test passes in, and the fleet leaving such a destination out."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.core.fleet import Call, Fleet, Router
from control_plane.core.fleet.backoff import Backoff
from tests.control_plane.fleet.members import FakeMember


def test_a_failed_destination_sits_out_a_back_off_that_doubles_and_resets_when_a_move_lands() -> None:
    off = Backoff(first_s=0.5, max_s=4.0)
    assert off.allows("d", 0.0)
    assert off.failed("d", 0.0) == 0.5
    assert not off.allows("d", 0.49) and off.allows("d", 0.5)
    off.started("d")  # the probe
    assert off.failed("d", 0.6) == 1.0
    assert not off.allows("d", 1.59) and off.allows("d", 1.6)
    off.started("d")
    assert off.failed("d", 2.0) == 2.0
    off.started("d")
    assert off.failed("d", 5.0) == 4.0  # at most max_s
    off.started("d")
    off.landed("d")
    assert off.allows("d", 5.0) and not off.on_probation("d")
    assert off.failed("d", 6.0) == 0.5, "a landed move starts the count afresh"


def test_failures_of_one_burst_count_once_and_a_probe_goes_alone() -> None:
    off = Backoff(first_s=0.5)
    assert off.failed("d", 0.0) == 0.5
    assert off.failed("d", 0.1) == 0.4, "moves started before the first failure was known"
    assert off.allows("d", 0.5) and off.on_probation("d")
    off.started("d")
    assert not off.allows("d", 0.6), "one probe at a time"
    assert off.failed("d", 0.7) == 1.0


@settings(max_examples=200, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["fail", "start", "land"]), st.floats(0, 0.3)), max_size=40))
def test_moves_started_toward_a_failing_destination_are_one_per_back_off(
    events: list[tuple[str, float]],
) -> None:
    """However often a source asks, a destination that has failed gets at most one move started
    (the probe) between two failures, and none while it sits out."""
    off, now, probes = Backoff(first_s=0.5), 0.0, 0
    for what, dt in events:
        now += dt
        if what == "fail":
            off.failed("d", now)
            probes = 0
        elif what == "land":
            off.landed("d")
            probes = 0
        elif off.allows("d", now):
            off.started("d")
            probes += off.on_probation("d")
        assert probes <= 1


def test_the_fleet_leaves_a_destination_out_while_it_sits_out() -> None:
    clock = [0.0]
    router: Router[FakeMember] = Router("m")
    source = FakeMember("a", live=[Call(("r",), 10)])
    for member in (source, FakeMember("b"), FakeMember("c", running=3)):
        router.attach(member)
    fleet = Fleet(router, clock=lambda: clock[0])
    assert [m.to for m in fleet.drain(source).moves] == ["b"]
    fleet.started("b")
    fleet.moved("b", landed=False)
    assert [m.to for m in fleet.drain(source).moves] == ["c"], "the other candidate is tried"
    clock[0] = 0.5
    assert [m.to for m in fleet.drain(source).moves] == ["b"], "its time is up: a probe"
    fleet.started("b")
    assert [m.to for m in fleet.drain(source).moves] == ["c"], "no second move while the probe is out"
    fleet.moved("b", landed=True)
    assert [m.to for m in fleet.drain(source).moves] == ["b"]


def test_a_drain_sends_at_most_one_call_to_a_destination_on_probation() -> None:
    clock = [0.0]
    router: Router[FakeMember] = Router("m")
    source = FakeMember("a", live=[Call((f"r{i}",), 10) for i in range(6)])
    for member in (source, FakeMember("b"), FakeMember("c", running=20)):
        router.attach(member)
    fleet = Fleet(router, clock=lambda: clock[0])
    fleet.moved("b", landed=False)
    clock[0] = 1.0
    assert Counter(m.to for m in fleet.drain(source).moves) == {"b": 1, "c": 5}
