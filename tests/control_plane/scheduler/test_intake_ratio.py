"""Request intake (docs/scheduler.md#intake) and the new-token-ratio tracker
(docs/scheduler.md#new-token-ratio)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.request import AbortCode, FinishKind
from control_plane.scheduler.adder import AdderLimits, AddReqResult, PrefillAdder
from control_plane.scheduler.ratio import NewTokenRatioTracker
from control_plane.scheduler.scheduler import clamp_max_new_tokens
from tests.control_plane.factories import EOS, FakeWorker, make_config, make_scheduler, params, prompt, run

# --- docs/scheduler.md#intake max_new_tokens clamping
# ------------------------------------------------------------------
#
# max_new_tokens = max(0, min(requested, max_req_len - input - 1, T - ceil_page(input) - page - 1)),
# max_req_len = min(context - 1, T - 1), requested None -> 2^30, a limit > 0 caps requested.


@pytest.mark.parametrize(
    ("capacity", "page", "context", "input_len", "requested", "limit", "expected"),
    [
        # The request binds: min(16, 2047 - 100 - 1 = 1946, 4096 - 100 - 1 - 1 = 3994) = 16.
        (4096, 1, 2048, 100, 16, None, 16),
        # The context binds: max_req_len = 1023; min(2^30, 1023 - 1000 - 1 = 22, 4096 - 1000 - 2 = 3094) = 22.
        (4096, 1, 1024, 1000, None, None, 22),
        # The pool binds, with pages: max_req_len = min(4095, 255) = 255; ceil_16(100) = 112;
        # min(2^30, 255 - 100 - 1 = 154, 256 - 112 - 16 - 1 = 127) = 127.
        (256, 16, 4096, 100, None, None, 127),
        # Pages of 4: ceil_4(9) = 12; min(500, 63 - 9 - 1 = 53, 64 - 12 - 4 - 1 = 47) = 47.
        (64, 4, 4096, 9, 500, None, 47),
        # Page 1, T < context: both bounds are T - input - 2 = 256 - 100 - 2 = 154.
        (256, 1, 4096, 100, None, None, 154),
        # The limit binds: min(100, 7) = 7 before the other rules (1946, 3994).
        (4096, 1, 2048, 100, 100, 7, 7),
        # The limit caps an absent request too: min(2^30, 7) = 7.
        (4096, 1, 2048, 100, None, 7, 7),
        # A limit <= 0 is off: min(100, 1946, 3994) = 100.
        (4096, 1, 2048, 100, 100, 0, 100),
        (4096, 1, 2048, 100, 100, -1, 100),
        # Requested 0 stays 0.
        (4096, 1, 2048, 100, 0, None, 0),
        # Floored at 0: ceil_16(250) = 256, 256 - 256 - 16 - 1 = -17 -> max(0, min(..., 4, -17)) = 0.
        (256, 16, 4096, 250, None, None, 0),
    ],
)
def test_max_new_tokens_clamp(
    capacity: int,
    page: int,
    context: int,
    input_len: int,
    requested: int | None,
    limit: int | None,
    expected: int,
) -> None:
    """docs/scheduler.md#intake init_req_max_new_tokens on concrete inputs, one rule binding at a time."""
    max_req_len = min(context - 1, capacity - 1)
    assert clamp_max_new_tokens(requested, input_len, max_req_len, capacity, page, limit) == expected


@settings(max_examples=200, deadline=None)
@given(
    page=st.sampled_from([1, 4]),
    pages=st.integers(8, 400),
    context=st.integers(16, 4000),
    input_len=st.integers(1, 4000),
    requested=st.one_of(st.none(), st.integers(0, 10_000)),
)
def test_a_request_accepted_at_intake_is_admitted_on_an_empty_pool(
    page: int, pages: int, context: int, input_len: int, requested: int | None
) -> None:
    """docs/scheduler.md#intake's purpose: whatever the clamp leaves, a request accepted at intake passes
    the adder's gate on an empty pool (docs/scheduler.md#add-one-req step 6), so its first pass admits it;
    and it never
    exceeds what was asked, nor
    its context. (Pages of up to 4: for larger pages see the test below.)"""
    sched = make_scheduler(
        capacity=pages * page, page_size=page, max_context=context, chunked_prefill_size=None
    )
    req = sched.add_request("r", prompt(input_len), params(requested))
    if req.finished:  # refused at intake (docs/scheduler.md#intake input length)
        return
    assert requested is None or req.max_new_tokens <= requested
    assert input_len + req.max_new_tokens < context
    plan = sched.next_plan()
    assert plan is not None and plan.extends.handles.tolist() == [req.handle]


def test_a_request_accepted_at_intake_is_served_with_large_pages() -> None:
    """docs/scheduler.md#intake: the clamp "guarantees any admitted request can pass the PrefillAdder's
    total-token gate when the pool is empty". T = 1024, pages of 16, context 4096: max_req_len = 1023, so
    SGLang's check accepts inputs up to 1023 - 5 - 1 = 1017. Input 1010: max_new = max(0, min(2^30, 1023 -
    1010 - 1 = 12, 1024 - ceil_16(1010) - 16 - 1 = -17)) = 0, and the gate (docs/scheduler.md#add-one-req
    step 6) needs total = 1010 + 0 + 16 = 1026 < 1024: never true, so it waited forever. Inputs of T -
    page = 1008 or more are
    now
    refused at intake (with the input-length message), so every request finishes."""
    sched = make_scheduler(capacity=1024, page_size=16, max_context=4096, chunked_prefill_size=None)
    out = run(sched, FakeWorker(1024, eos=EOS), [(0, "r", prompt(1010), params(None))], max_steps=20)
    assert "r" in out.finished and sched.is_idle
    assert out.finished["r"].kind is FinishKind.ABORT and out.finished["r"].message.startswith("Input length")


def test_scheduler_clamps_at_intake_and_the_request_is_admissible() -> None:
    sched = make_scheduler(capacity=256, max_context=4096, chunked_prefill_size=None)
    req = sched.add_request("big", prompt(100), params(None))
    # T = 256, page 1, context 4096: min(2^30, 255 - 100 - 1, 256 - 100 - 1 - 1) = 154.
    assert req.max_new_tokens == 154
    adder = PrefillAdder(sched.kv, AdderLimits(1, 16384, None, clip_max_new_tokens=4096), [], 0.7)
    sched.kv.match_prefix(req, req.seqlen - 1)
    assert adder.add_one_req(req, ignore_eos_path=False) is not AddReqResult.NO_TOKEN


def test_max_new_tokens_limit_applies() -> None:
    sched = make_scheduler(max_new_tokens_limit=7)
    assert sched.add_request("a", prompt(10), params(100)).max_new_tokens == 7
    assert sched.add_request("b", prompt(10, 1), params(None)).max_new_tokens == 7


def test_zero_max_new_tokens_runs_one_prefill_and_finishes() -> None:
    out = run(make_scheduler(), FakeWorker(4096, eos=EOS), [(0, "z", prompt(10), params(0))])
    assert out.tokens["z"] == [] and out.finished["z"].kind is FinishKind.LENGTH


# --- docs/scheduler.md#intake input length
# ------------------------------------------------------------------------------


def test_too_long_input_is_aborted_with_sglangs_message() -> None:
    sched = make_scheduler(capacity=4096, max_context=1024)
    # max_req_len = 1023, max_req_input_len = 1018.
    sched.add_request("ok", prompt(1017), params(1))
    sched.add_request("long", prompt(1018), params(1))
    finished = {f.rid: f.reason for f in sched.take_updates().finished}["long"]
    assert finished.code is AbortCode.INVALID
    assert finished.message.startswith(
        "Input length (1018 tokens) exceeds the maximum allowed length (1018 tokens)."
    )
    assert [r.rid for r in sched.waiting] == ["ok"]


def test_auto_truncate_cuts_to_the_maximum_input_length() -> None:
    sched = make_scheduler(capacity=4096, max_context=1024, allow_auto_truncate=True)
    req = sched.add_request("long", prompt(1500), params(4))
    assert req.origin_input_ids == prompt(1500)[:1018]
    assert sched.take_updates().empty


# --- docs/scheduler.md#new-token-ratio new_token_ratio
# -------------------------------------------------------------------------------


# docs/scheduler.md#new-token-ratio defaults: init 0.7, floor 0.7 · 0.14 = 0.098, decay (0.7 - 0.098) / 600 =
# 0.602 / 600.
DEFAULT_DECAY = 0.0010033333


def test_ratio_defaults() -> None:
    ratio = NewTokenRatioTracker.from_config(make_config())
    assert ratio.init == pytest.approx(0.7) and ratio.current == ratio.init
    assert ratio.min == pytest.approx(0.098)
    assert ratio.decay == pytest.approx(DEFAULT_DECAY)


@pytest.mark.parametrize(
    ("conservativeness", "init", "floor", "decay"),
    [
        # init 0.7 · 0.3 = 0.21, floor 0.21 · 0.14 = 0.0294, decay (0.21 - 0.0294) / 600 = 0.000301.
        (0.3, 0.21, 0.0294, 0.000301),
        # init min(0.7 · 2, 1) = 1.0, floor 0.14, decay 0.86 / 600 = 0.00143333.
        (2.0, 1.0, 0.14, 0.0014333333),
    ],
)
def test_ratio_scales_with_conservativeness(
    conservativeness: float, init: float, floor: float, decay: float
) -> None:
    ratio = NewTokenRatioTracker.from_config(make_config(schedule_conservativeness=conservativeness))
    assert (ratio.init, ratio.min, ratio.decay) == pytest.approx((init, floor, decay))


def test_ratio_decays_to_the_floor_and_resets() -> None:
    ratio = NewTokenRatioTracker.from_config(make_config())
    ratio.decay_step()
    assert ratio.current == pytest.approx(0.6989966667)  # 0.7 - 0.602 / 600
    for _ in range(700):
        ratio.decay_step()
    assert ratio.current == ratio.min
    ratio.reset()
    assert ratio.current == ratio.init


def test_ratio_decays_once_per_decode_step_only() -> None:
    sched = make_scheduler(chunked_prefill_size=64)
    out = run(sched, FakeWorker(4096, eos=EOS), [(0, "a", prompt(200), params(10))])
    decodes = sum(1 for p in out.plans if len(p.decodes))
    assert decodes == 9  # 4 prefill passes (3 chunks + last) sample the first token
    assert sched.ratio.current == pytest.approx(0.69097)  # 0.7 - 9 · 0.602 / 600
    assert sched.is_idle
    sched.on_idle()
    assert sched.ratio.current == pytest.approx(0.7)


def test_mixed_steps_do_not_decay_the_ratio() -> None:
    sched = make_scheduler(chunked_prefill_size=64, enable_mixed_chunk=True)
    arrivals = [(0, "a", prompt(10), params(8)), (1, "b", prompt(300, 1), params(1))]
    out = run(sched, FakeWorker(4096, eos=EOS), arrivals)
    pure_decodes = sum(1 for p in out.plans if len(p.decodes) and not len(p.extends))
    assert sched.ratio.current == pytest.approx(0.7 - pure_decodes * DEFAULT_DECAY)
