"""PrefillAdder budget arithmetic (docs/scheduler.md#prefill-adder-budgets, #priority-preemption; SGLang's
test_prefill_adder.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from control_plane.request import Request
from control_plane.scheduler.adder import AdderLimits, AddReqResult, PrefillAdder
from control_plane.scheduler.kv import KvManager
from tests.control_plane.factories import params, prompt


def make_kv(available: int, evictable: int = 0, page_size: int = 1) -> KvManager:
    """A pool with exactly `available` free and `evictable` tree-owned, unlocked slots."""
    kv = KvManager(available + evictable, page_size, max_running_requests=16, max_context=8192)
    if evictable:
        slots = kv.allocator.alloc(evictable)
        assert slots is not None
        kv.tree.insert(prompt(evictable, seed=999), slots)
    assert (kv.available_size(), kv.evictable_size()) == (available, evictable)
    return kv


def make_req(
    rid: str,
    prompt_len: int = 10,
    max_new: int = 16,
    generated: int = 0,
    priority: int | None = None,
    seed: int = 0,
) -> Request:
    req = Request(rid=rid, origin_input_ids=prompt(prompt_len, seed), params=params(max_new))
    req.max_new_tokens = max_new
    req.output_ids = [5] * generated
    req.priority = priority
    return req


def matched(req: Request) -> Request:
    """The request as an earlier pass left it after matching it (and finding nothing cached): its fill
    is its whole sequence (docs/scheduler.md#priority-preemption)."""
    req.matched_fill_len = req.seqlen
    return req


def limits(
    chunk: int | None = None, max_prefill: int = 16384, page_size: int = 1, low_first: bool = False
) -> AdderLimits:
    return AdderLimits(
        page_size=page_size,
        max_prefill_tokens=max_prefill,
        chunked_prefill_size=chunk,
        low_priority_values_first=low_first,
    )


def least_important_first(running: Sequence[Request], low_first: bool) -> list[Request]:
    """docs/scheduler.md#priority-preemption step 1: ascending by (priority·(−s), −entry time)."""
    s = 1 if low_first else -1
    return sorted(running, key=lambda r: ((r.priority or 0) * -s, -r.wait_queue_entry_time))


def admit(kv: KvManager, adder: PrefillAdder, req: Request) -> AddReqResult:
    kv.match_prefix(req, max(req.seqlen - 1, 0))
    return adder.add_one_req(req, ignore_eos_path=False)


# --- docs/scheduler.md#prefill-adder-budgets constructor budgets
# -------------------------------------------------------------------


def test_mixed_chunk_budgets_match_the_spec_example() -> None:
    running = [make_req(f"r{i}", max_new=50) for i in range(8)]
    adder = PrefillAdder(
        make_kv(10_000), limits(chunk=64, max_prefill=200), running, 1.0, mixed_decode_tokens=8
    )
    assert adder.rem_input_tokens == 192
    assert adder.rem_chunk_tokens == 56
    assert adder.rem_total_token_offset == 408
    assert adder.cur_rem_token_offset == 8


def test_reserved_offset_is_remaining_max_new_times_ratio() -> None:
    running = [make_req("a", max_new=50), make_req("b", max_new=75), make_req("c", max_new=100)]
    adder = PrefillAdder(make_kv(1000), limits(), running, 1.0)
    assert adder.rem_total_token_offset == 225
    half = PrefillAdder(make_kv(1000), limits(), running, 0.5)
    assert half.rem_total_token_offset == pytest.approx(112.5)


def test_offset_counts_generated_tokens_and_clips_at_4096() -> None:
    running = [make_req("a", max_new=100, generated=40), make_req("b", max_new=10_000)]
    adder = PrefillAdder(make_kv(1000), limits(), running, 1.0)
    assert adder.rem_total_token_offset == 60 + 4096


def test_mixed_chunk_verdicts() -> None:
    running = [make_req(f"r{i}", max_new=50) for i in range(8)]
    kv = make_kv(10_000)
    adder = PrefillAdder(kv, limits(chunk=64, max_prefill=200), running, 1.0, mixed_decode_tokens=8)
    assert admit(kv, adder, make_req("small", prompt_len=20, seed=1)) is AddReqResult.CONTINUE
    assert adder.rem_chunk_tokens == 36
    assert admit(kv, adder, make_req("fill", prompt_len=36, seed=2)) is AddReqResult.OTHER
    assert adder.rem_chunk_tokens == 0


# --- docs/scheduler.md#prefill-adder-budgets, #add-one-req verdicts
# --------------------------------------------------------------------------


def test_total_gate_is_strict() -> None:
    kv = make_kv(100)
    # total = 50 + 48 + 1 = 99 < 100: admitted, with one token of total budget left.
    adder = PrefillAdder(kv, limits(), [], 0.7)
    assert admit(kv, adder, make_req("fits", prompt_len=50, max_new=48)) is AddReqResult.CONTINUE
    assert adder.can_run_list and adder.rem_total_tokens == 1
    assert admit(kv, adder, make_req("next", prompt_len=1, max_new=0, seed=3)) is AddReqResult.NO_TOKEN
    # total = 50 + 49 + 1 = 100 >= 100: refused.
    adder = PrefillAdder(kv, limits(), [], 0.7)
    assert admit(kv, adder, make_req("exact", prompt_len=50, max_new=49)) is AddReqResult.NO_TOKEN
    assert not adder.can_run_list


def test_first_request_may_exceed_max_prefill_without_chunking() -> None:
    kv = make_kv(10_000)
    adder = PrefillAdder(kv, limits(chunk=None, max_prefill=100), [], 0.7)
    assert admit(kv, adder, make_req("big", prompt_len=300)) is AddReqResult.OTHER
    assert [r.rid for r in adder.can_run_list] == ["big"]
    adder = PrefillAdder(kv, limits(chunk=None, max_prefill=100), [], 0.7)
    assert admit(kv, adder, make_req("a", prompt_len=40, seed=1)) is AddReqResult.CONTINUE
    assert admit(kv, adder, make_req("b", prompt_len=60, seed=2)) is AddReqResult.OTHER
    assert [r.rid for r in adder.can_run_list] == ["a"]


def test_prefill_max_requests_caps_the_batch() -> None:
    kv = make_kv(10_000)
    lim = AdderLimits(
        page_size=1, max_prefill_tokens=16384, chunked_prefill_size=None, prefill_max_requests=1
    )
    adder = PrefillAdder(kv, lim, [], 0.7)
    assert admit(kv, adder, make_req("a", seed=1)) is AddReqResult.CONTINUE
    assert admit(kv, adder, make_req("b", seed=2)) is AddReqResult.OTHER
    assert len(adder.can_run_list) == 1


def test_chunk_is_page_floored_and_reserves_no_decode() -> None:
    kv = make_kv(10_000, page_size=4)
    adder = PrefillAdder(kv, limits(chunk=64, page_size=4), [], 0.7)
    req = make_req("long", prompt_len=100, max_new=30)
    assert admit(kv, adder, req) is AddReqResult.OTHER
    assert req.extend_range == (0, 64) and adder.new_chunked_req is req
    assert adder.rem_total_token_offset == 64 + 0 + 4


def test_worked_example_of_section_3_7() -> None:
    kv = make_kv(6000, evictable=1000)
    running = [make_req(f"run{i}", max_new=1000, generated=100, seed=50 + i) for i in range(2)]
    lim = limits(chunk=2048, max_prefill=16384)
    adder = PrefillAdder(kv, lim, running, 0.7)
    assert adder.rem_total_tokens == pytest.approx(5740)
    assert adder.cur_rem_tokens == 7000
    r1 = make_req("R1", prompt_len=3000, max_new=512, seed=1)
    r2 = make_req("R2", prompt_len=500, max_new=64, seed=2)
    assert admit(kv, adder, r1) is AddReqResult.OTHER
    assert r1.extend_range == (0, 2048) and adder.new_chunked_req is r1
    assert adder.rem_total_tokens == pytest.approx(3691)
    assert adder.cur_rem_tokens == 4951
    assert (adder.rem_input_tokens, adder.rem_chunk_tokens) == (14336, 0)
    # The worker computes the first chunk; the next pass stashes it into the tree.
    kv.alloc_for_extend([r1])
    r1.kv_committed_len = 2048
    kv.cache_unfinished_req(r1, chunked=True)
    assert len(r1.prefix_indices) == 2048 and kv.protected_size() == 2048
    adder = PrefillAdder(kv, lim, running, 0.7)
    assert adder.add_chunked_req(r1) is None  # the last chunk
    assert r1.extend_range == (2048, 3000)
    assert adder.rem_chunk_tokens == 2048 - 952
    assert adder.rem_total_token_offset == pytest.approx(1260 + 952 + 512 + 1)
    assert admit(kv, adder, r2) is AddReqResult.CONTINUE
    assert [r.rid for r in adder.can_run_list] == ["R1", "R2"]
    assert r2.extend_range == (0, 500) and adder.rem_chunk_tokens == 1096 - 500


def test_continuation_is_forced_even_without_total_budget() -> None:
    kv = make_kv(100)
    req = make_req("chunked", prompt_len=300)
    req.prefix_indices = np.zeros(0, dtype=np.int64)
    adder = PrefillAdder(kv, limits(chunk=64), [make_req("big", max_new=4000)], 0.7)
    assert adder.rem_total_tokens < 0
    assert adder.add_chunked_req(req) is req
    assert req.extend_range == (0, 64)


# --- docs/scheduler.md#priority-preemption priority preemption
# -----------------------------------------------------------------------


def three_running(low_first: bool) -> list[Request]:
    """Offsets 50, 75, 100 (ratio 1.0); the 50 is least important by default, the 100 with low-first."""
    prios = (1, 5, 10)
    reqs = [
        make_req(f"r{n}", max_new=n, priority=p, seed=n) for n, p in zip((50, 75, 100), prios, strict=True)
    ]
    for t, r in enumerate(reqs):
        r.wait_queue_entry_time = t
    return reqs


@pytest.mark.parametrize(
    ("low_first", "new_priority", "victim", "after"), [(False, 20, "r50", 175), (True, -5, "r100", 125)]
)
def test_preemption_picks_least_important_and_subtracts_its_offset(
    low_first: bool, new_priority: int, victim: str, after: float
) -> None:
    running = three_running(low_first)
    # rem_total = 300 − 225 = 75; the newcomer, never matched, needs 0 + 50 − 75 < 0: the walk still takes
    # the first qualifying candidate before it checks.
    kv = make_kv(300)
    adder = PrefillAdder(kv, limits(low_first=low_first), running, 1.0)
    assert adder.rem_total_token_offset == 225
    new = make_req("new", prompt_len=50, max_new=50, priority=new_priority, seed=7)
    chosen = adder.preempt_to_schedule(new, least_important_first(running, low_first))
    assert chosen is not None and [r.rid for r in chosen] == [victim]
    assert adder.rem_total_token_offset == after


@pytest.mark.parametrize("low_first", [False, True])
def test_preemption_needs_a_gap_above_the_threshold(low_first: bool) -> None:
    running = three_running(low_first)
    least = least_important_first(running, low_first)
    gap_10 = least[0].priority + (10 if not low_first else -10)  # type: ignore[operator]
    adder = PrefillAdder(make_kv(300), limits(low_first=low_first), running, 1.0)
    new = make_req("new", prompt_len=50, max_new=50, priority=gap_10, seed=7)
    assert adder.preempt_to_schedule(new, least) is None
    assert adder.rem_total_token_offset == 225


def test_preemption_fails_when_victims_cannot_free_enough() -> None:
    running = three_running(low_first=False)
    adder = PrefillAdder(make_kv(300), limits(), running, 1.0)
    # 500 short, and all three together free only 225.
    new = matched(make_req("new", prompt_len=500, max_new=75, priority=100, seed=7))
    assert adder.preempt_to_schedule(new, least_important_first(running, False)) is None
    assert adder.rem_total_token_offset == 225


def test_preempted_requests_are_never_chosen_twice() -> None:
    running = three_running(low_first=False)
    adder = PrefillAdder(make_kv(300), limits(), running, 1.0)
    order = least_important_first(running, False)
    first = adder.preempt_to_schedule(make_req("n1", prompt_len=50, max_new=50, priority=30, seed=7), order)
    second = adder.preempt_to_schedule(make_req("n2", prompt_len=100, max_new=50, priority=30, seed=8), order)
    assert first is not None and second is not None
    assert {r.rid for r in first}.isdisjoint(r.rid for r in second)


def test_multi_victim_preemption() -> None:
    reqs = [make_req(f"r{n}", max_new=n, priority=p, seed=n) for n, p in ((100, 1), (125, 2), (250, 3))]
    adder = PrefillAdder(make_kv(500), limits(), reqs, 1.0)
    assert adder.rem_total_token_offset == 475
    # rem_total = 25; needs 150 + 50 → 175 short: the first two (100 + 125) cover it.
    new = matched(make_req("new", prompt_len=150, max_new=50, priority=50, seed=7))
    chosen = adder.preempt_to_schedule(new, least_important_first(reqs, False))
    assert chosen is not None and [r.rid for r in chosen] == ["r100", "r125"]
    assert adder.rem_total_token_offset == 250


def test_a_newcomer_never_matched_needs_room_for_its_decode_only() -> None:
    """SGLang's fill is empty until the request's first match (after the preemption): the same newcomer
    as above, never matched, needs 0 + 50 − 25 = 25, which the first victim's 100 covers."""
    reqs = [make_req(f"r{n}", max_new=n, priority=p, seed=n) for n, p in ((100, 1), (125, 2), (250, 3))]
    adder = PrefillAdder(make_kv(500), limits(), reqs, 1.0)
    new = make_req("new", prompt_len=150, max_new=50, priority=50, seed=7)
    chosen = adder.preempt_to_schedule(new, least_important_first(reqs, False))
    assert chosen is not None and [r.rid for r in chosen] == ["r100"]
    assert adder.rem_total_token_offset == 375


def test_a_chunked_request_is_the_last_one_admitted() -> None:
    # Mixed chunk leaves the chunk budget off the page grid: 64 − 1 decode token = 63.
    kv = make_kv(10_000, page_size=4)
    adder = PrefillAdder(kv, limits(chunk=64, page_size=4), [make_req("run")], 0.7, mixed_decode_tokens=1)
    first = make_req("first", prompt_len=70, seed=1)
    admit(kv, adder, first)
    assert adder.new_chunked_req is first and first.extend_range == (0, 60)
    assert adder.rem_chunk_tokens == 3
    # The ignore_eos path chunks by exactly rem_chunk_tokens; it must not start a second chunk.
    late = make_req("late", prompt_len=10, seed=2)
    kv.match_prefix(late, late.seqlen - 1)
    assert adder.add_one_req(late, ignore_eos_path=True) is AddReqResult.OTHER
    assert adder.new_chunked_req is first and [r.rid for r in adder.can_run_list] == ["first"]
