"""Request intake (SCHEDULER.md §1.5) and the new-token-ratio tracker (§5)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.request import AbortCode, FinishKind
from control_plane.scheduler.adder import AdderLimits, AddReqResult, PrefillAdder
from control_plane.scheduler.ratio import NewTokenRatioTracker
from control_plane.scheduler.scheduler import clamp_max_new_tokens
from tests.control_plane.factories import EOS, FakeWorker, make_config, make_scheduler, params, prompt, run

# --- §1.5 max_new_tokens clamping ------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    page=st.sampled_from([1, 4, 16]),
    pages=st.integers(4, 400),
    context=st.integers(8, 4000),
    input_len=st.integers(1, 4000),
    requested=st.one_of(st.none(), st.integers(0, 10_000)),
    limit=st.one_of(st.none(), st.integers(-1, 5000)),
)
def test_max_new_tokens_clamp_is_tight(
    page: int, pages: int, context: int, input_len: int, requested: int | None, limit: int | None
) -> None:
    capacity = pages * page
    max_req_len = min(context - 1, capacity - 1)
    got = clamp_max_new_tokens(requested, input_len, max_req_len, capacity, page, limit)
    ceil_input = -(-input_len // page) * page
    wanted = 2**30 if requested is None else requested
    if limit is not None and limit > 0:
        wanted = min(wanted, limit)
    rules = (wanted, max_req_len - input_len - 1, capacity - ceil_input - page - 1)
    assert got >= 0 and all(got <= bound for bound in rules if bound >= 0)
    # Tight: zero, or one more token would break a rule.
    assert got == 0 or any(got + 1 > bound for bound in rules)
    if got > 0:  # admissible on an empty pool (§3.7 step 6's strict gate)
        assert input_len + got + page < capacity


def test_scheduler_clamps_at_intake_and_the_request_is_admissible() -> None:
    sched = make_scheduler(capacity=256, max_context=4096, chunked_prefill_size=None)
    req = sched.add_request("big", prompt(100), params(None))
    assert req.max_new_tokens == 256 - 100 - 1 - 1
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


# --- §1.5 input length ------------------------------------------------------------------------------


def test_too_long_input_is_aborted_with_sglangs_message() -> None:
    sched = make_scheduler(capacity=4096, max_context=1024)
    # max_req_len = 1023, max_req_input_len = 1018.
    sched.add_request("ok", prompt(1017), params(1))
    sched.add_request("long", prompt(1018), params(1))
    update = {u.rid: u for u in sched.take_updates()}["long"]
    assert update.finished is not None and update.finished.code is AbortCode.INVALID
    assert update.finished.message.startswith(
        "Input length (1018 tokens) exceeds the maximum allowed length (1018 tokens)."
    )
    assert [r.rid for r in sched.waiting] == ["ok"]


def test_auto_truncate_cuts_to_the_maximum_input_length() -> None:
    sched = make_scheduler(capacity=4096, max_context=1024, allow_auto_truncate=True)
    req = sched.add_request("long", prompt(1500), params(4))
    assert req.origin_input_ids == prompt(1500)[:1018]
    assert not sched.take_updates()


# --- §5 new_token_ratio -------------------------------------------------------------------------------


def test_ratio_defaults() -> None:
    ratio = NewTokenRatioTracker.from_config(make_config())
    assert ratio.init == pytest.approx(0.7) and ratio.current == ratio.init
    assert ratio.min == pytest.approx(0.098)
    assert ratio.decay == pytest.approx((0.7 - 0.098) / 600)
    assert ratio.decay == pytest.approx(0.0010033, abs=1e-7)


@pytest.mark.parametrize(("conservativeness", "init", "floor"), [(0.3, 0.21, 0.0294), (2.0, 1.0, 0.14)])
def test_ratio_scales_with_conservativeness(conservativeness: float, init: float, floor: float) -> None:
    ratio = NewTokenRatioTracker.from_config(make_config(schedule_conservativeness=conservativeness))
    assert (ratio.init, ratio.min) == pytest.approx((init, floor))
    assert ratio.decay == pytest.approx((init - floor) / 600)


def test_ratio_decays_to_the_floor_and_resets() -> None:
    ratio = NewTokenRatioTracker.from_config(make_config())
    ratio.decay_step()
    assert ratio.current == pytest.approx(0.7 - ratio.decay)
    for _ in range(700):
        ratio.decay_step()
    assert ratio.current == ratio.min
    ratio.reset()
    assert ratio.current == ratio.init


def test_ratio_decays_once_per_decode_step_only() -> None:
    sched = make_scheduler(chunked_prefill_size=64)
    decay = sched.ratio.decay
    out = run(sched, FakeWorker(4096, eos=EOS), [(0, "a", prompt(200), params(10))])
    decodes = sum(1 for p in out.plans if len(p.decodes))
    assert decodes == 9  # 4 prefill passes (3 chunks + last) sample the first token
    assert sched.ratio.current == pytest.approx(0.7 - decodes * decay)
    assert sched.is_idle
    sched.on_idle()
    assert sched.ratio.current == pytest.approx(0.7)


def test_mixed_steps_do_not_decay_the_ratio() -> None:
    sched = make_scheduler(chunked_prefill_size=64, enable_mixed_chunk=True)
    arrivals = [(0, "a", prompt(10), params(8)), (1, "b", prompt(300, 1), params(1))]
    out = run(sched, FakeWorker(4096, eos=EOS), arrivals)
    pure_decodes = sum(1 for p in out.plans if len(p.decodes) and not len(p.extends))
    assert sched.ratio.current == pytest.approx(0.7 - pure_decodes * sched.ratio.decay)
