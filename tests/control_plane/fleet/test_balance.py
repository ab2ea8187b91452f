"""The KV balancer's rules (control_plane/core/fleet/balance.py) and the scheduler's look-ahead they read
(`decode_headroom`): a worker whose headroom over the next k decodes is not negative does not
retract in those k steps, and one whose headroom for the next decode is negative retracts in it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.core.fleet.balance import BALANCE, KV, Room, fits, roomiest, why_move
from tests.control_plane.factories import make_scheduler, params
from tests.control_plane.fake_worker import FakeWorker

# --- the look-ahead ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4, 16]),
    lens=st.lists(st.tuples(st.integers(1, 100), st.integers(0, 40)), min_size=1, max_size=8),
)
def test_growth_need_counts_every_new_page(page: int, lens: list[tuple[int, int]]) -> None:
    kv = make_scheduler(page_size=page).kv
    seq_lens = np.array([s for s, _ in lens], dtype=np.int64)
    growth = np.array([g for _, g in lens], dtype=np.int64)
    # A position p needs a new slot when it starts a page beyond the sequence's last one.
    brute = sum(
        page * sum(1 for pos in range(s, s + g) if pos % page == 0 and pos >= -(-s // page) * page)
        for s, g in lens
    )
    assert kv.growth_need(seq_lens, growth) == brute


@settings(max_examples=60, deadline=None)
@given(
    page=st.sampled_from([1, 4]),
    pages=st.integers(20, 60),
    shapes=st.lists(st.tuples(st.integers(4, 30), st.integers(20, 120)), min_size=3, max_size=8),
    ahead=st.integers(1, 12),
)
def test_a_headroom_predicts_retraction(
    page: int, pages: int, shapes: list[tuple[int, int]], ahead: int
) -> None:
    """No arrivals after the first prefill: headroom(k) >= 0 means no retraction in the next k
    steps, and headroom(1) < 0 means the next step retracts."""
    capacity = pages * 4
    sched = make_scheduler(capacity=capacity, page_size=page, init_new_token_ratio=0.1)
    worker = FakeWorker(capacity, vocab=1000)
    for i, (n, max_new) in enumerate(shapes):
        sched.add_request(f"r{i}", [7 + i] * n, params(max_new, ignore_eos=True))
    predicted_safe_until = -1
    retracted_at: list[int] = []
    for step in range(400):
        queue = bool(sched.waiting) or sched.chunked_req is not None
        if not queue and len(sched.running):
            if sched.decode_headroom(ahead) >= 0:
                predicted_safe_until = max(predicted_safe_until, step + ahead - 1)
            short = sched.decode_headroom(1) < 0
        else:
            short = False
        plan = sched.next_plan()
        if plan is None:
            break
        sched.apply_result(worker.run(plan))
        stats = sched.last_stats
        retracted = bool(stats is not None and stats.retracted)
        if retracted:
            retracted_at.append(step)
            assert step > predicted_safe_until, (
                f"retracted at step {step}, predicted safe to {predicted_safe_until}"
            )
        if short:
            assert retracted, f"headroom(1) < 0 at step {step} but the step did not retract"


def test_the_retraction_order_is_what_a_retraction_releases_first() -> None:
    sched = make_scheduler(capacity=4096)
    worker = FakeWorker(4096, vocab=1000)
    for i, (n, max_new) in enumerate([(10, 50), (30, 50), (20, 50)]):
        sched.add_request(f"r{i}", [3 + i] * n, params(max_new, ignore_eos=True))
    for _ in range(3):
        plan = sched.next_plan()
        assert plan is not None
        sched.apply_result(worker.run(plan))
    # Same outputs: the longest prompt goes first (it frees the most), the shortest last (SGLang's).
    assert sched.retraction_order() == ["r1", "r2", "r0"]


# --- the rules ----------------------------------------------------------------------------------


def test_a_worker_short_of_kv_moves_to_one_with_room() -> None:
    assert why_move(Room(-5, 100, 0), Room(50, 100, 0), 0.3) == KV
    assert why_move(Room(-5, 100, 0), Room(0, 100, 0), 0.3) is None, "no room there"
    assert why_move(Room(-5, 100, 3), Room(-1, 100, 0), 0.3) is None


@pytest.mark.parametrize(
    ("here", "there", "moves"),
    [
        (Room(10, 100, 2), Room(60, 100, 0), True),  # a gap of 0.5 > 0.3, a queue here only
        (Room(10, 100, 2), Room(30, 100, 0), False),  # a gap of 0.2
        (Room(10, 100, 0), Room(90, 100, 0), False),  # no queue: routing's business
        (Room(10, 100, 2), Room(90, 100, 1), False),  # a queue there too
        (Room(10, 100, 2), Room(300, 1000, 0), False),  # shares, not slots: 0.1 vs 0.3
    ],
)
def test_a_queue_beside_free_kv_moves_past_the_threshold(here: Room, there: Room, moves: bool) -> None:
    assert (why_move(here, there, 0.3) == BALANCE) is moves


def test_a_move_must_fit_and_a_balancing_one_must_not_invert_the_gap() -> None:
    here, there = Room(-10, 100, 0), Room(40, 100, 0)
    assert fits(KV, here, there, 30, 8)
    assert not fits(KV, here, there, 35, 8), "the growth does not fit"
    here, there = Room(10, 100, 3), Room(70, 100, 0)
    assert fits(BALANCE, here, there, 20, 4)  # after: 46 there against 34 here
    assert not fits(BALANCE, here, there, 30, 4), "after: 36 there against 44 here: it would move back"


def test_the_roomiest_worker_is_the_largest_free_share() -> None:
    assert roomiest({"b": Room(50, 100, 0), "a": Room(400, 1000, 0), "c": Room(50, 100, 0)}) == "b"
    assert roomiest({}) is None
