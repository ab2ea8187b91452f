"""Prompt log probabilities in the scheduler (docs/scheduler.md#prompt-log-probabilities): which rows
a plan scores, the prefix-cache cap at the first position still to be scored, and that chunking,
retraction, overlap and the host pool neither lose nor repeat a row.

The fake worker labels each row with the position it scored and the token after it (read back
through the sequence's slots), so every check is exact.
"""

from __future__ import annotations

import pytest

from control_plane.request import FinishKind, RequestParams
from protos.worker import SamplerParams
from tests.control_plane.factories import Outcome, make_scheduler, prompt, run
from tests.control_plane.fake_worker import FakeWorker


def scoring(start: int, max_new_tokens: int = 4, logprobs: bool = True) -> RequestParams:
    return RequestParams(
        max_new_tokens=max_new_tokens,
        sampler=SamplerParams(temperature=0.0, logprobs=1),
        logprobs=logprobs,
        logprob_start_len=start,
    )


def expected_rows(ids: list[int], start: int) -> list[tuple[float, int]]:
    """Row p scores position p against token p + 1, for p from start to the second-to-last."""
    return [(float(p), ids[p + 1]) for p in range(start, len(ids) - 1)]


def rows_of(out: Outcome, rid: str) -> list[tuple[float, int]]:
    return [(row.logprob, row.top_ids[0]) for row in out.prompt_scores[rid].rows]


def scored_positions(out: Outcome) -> list[int]:
    """Every prompt position any plan asked the worker to score."""
    positions = []
    for plan in out.plans:
        ext = plan.extends
        for i in range(len(ext.score_lens)):
            first = int(ext.score_starts[i])
            positions.extend(range(first, first + int(ext.score_lens[i])))
    return positions


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("start", [0, 1, 100, 299])
def test_every_prompt_row_once_before_the_first_token(overlap: bool, chunk: int | None, start: int) -> None:
    ids = prompt(300)
    sched = make_scheduler(chunked_prefill_size=chunk)
    out = run(sched, FakeWorker(4096), [(0, "a", ids, scoring(start))], overlap=overlap)
    assert rows_of(out, "a") == expected_rows(ids, start)
    scoring_ = out.prompt_scores["a"]
    assert scoring_.start == start and scoring_.prompt == ids
    # Output tokens carry their logprobs: one per streamed token, each for that token.
    assert [lp.top_ids[0] for lp in out.scores["a"]] == out.tokens["a"]
    assert len(out.tokens["a"]) == 4
    assert scored_positions(out) == list(range(start, 299))


def test_the_prefix_cache_is_capped_at_the_first_position_to_score() -> None:
    """A cached prefix that reaches past the start is matched only up to it: positions from the
    start are computed again and scored; one before the start is used as usual."""
    ids = prompt(200)
    sched = make_scheduler()
    worker = FakeWorker(4096)
    run(sched, worker, [(0, "warm", ids, RequestParams(max_new_tokens=1, sampler=SamplerParams()))])
    out = run(sched, worker, [(0, "after", ids, scoring(150))])
    assert rows_of(out, "after") == expected_rows(ids, 150)
    new_seq = next(s for plan in out.plans for s in plan.new_seqs if s.request_id == "after")
    assert len(new_seq.prefix_slots) == 150
    assert out.plans[0].extends.starts.tolist() == [150]
    # Without scoring the same prompt matches all but its last token.
    plain = run(sched, worker, [(0, "plain", ids, RequestParams(max_new_tokens=1, sampler=SamplerParams()))])
    assert len(plain.plans[0].new_seqs[0].prefix_slots) == 199


def test_a_cached_prefix_short_of_the_start_is_used_whole() -> None:
    ids = prompt(200)
    sched = make_scheduler()
    worker = FakeWorker(4096)
    run(sched, worker, [(0, "warm", ids[:80], RequestParams(max_new_tokens=1, sampler=SamplerParams()))])
    out = run(sched, worker, [(0, "b", ids, scoring(150))])
    assert len(out.plans[0].new_seqs[0].prefix_slots) == 80
    assert rows_of(out, "b") == expected_rows(ids, 150)
    assert scored_positions(out) == list(range(150, 199))


def test_a_prompt_of_one_position_to_score_has_no_rows() -> None:
    ids = prompt(10)
    out = run(make_scheduler(), FakeWorker(4096), [(0, "c", ids, scoring(9))])
    assert out.prompt_scores["c"].rows == () and out.prompt_scores["c"].start == 9
    assert scored_positions(out) == []


def test_prefill_only_requests_get_their_scores_before_their_finish() -> None:
    """max_new_tokens 0 (a loglikelihood request): the scores, then a length finish, no token."""
    ids = prompt(50)
    out = run(
        make_scheduler(chunked_prefill_size=16),
        FakeWorker(4096),
        [(0, "d", ids, scoring(0, max_new_tokens=0))],
    )
    assert rows_of(out, "d") == expected_rows(ids, 0)
    assert out.tokens["d"] == [] and out.finished["d"].kind is FinishKind.LENGTH


def test_tokens_of_requests_that_did_not_ask_carry_no_logprobs() -> None:
    ids = prompt(40)
    plain = RequestParams(max_new_tokens=3, sampler=SamplerParams())
    arrivals = [(0, "asks", ids, scoring(-1)), (0, "not", prompt(40, seed=1), plain)]
    out = run(make_scheduler(), FakeWorker(4096), arrivals)
    assert len(out.scores["asks"]) == len(out.tokens["asks"]) == 4 and "not" not in out.scores
    assert out.prompt_scores == {}


@pytest.mark.parametrize("host_pool", [0, 8192])
@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_neither_loses_nor_repeats_rows_or_token_logprobs(overlap: bool, host_pool: int) -> None:
    """Forced retraction (TEST_RETRACT) of scoring requests mid-run, re-prefilled or backed up to the
    host pool: each one's prompt scores come once and whole, and its streamed tokens each carry
    exactly one logprob entry."""
    sched = make_scheduler(test_retract=True, chunked_prefill_size=32, host_pool=host_pool)
    arrivals = [(i, f"r{i}", prompt(90, seed=i), scoring(i * 7, max_new_tokens=12)) for i in range(6)]
    out = run(sched, FakeWorker(4096), arrivals, overlap=overlap)
    assert sched.num_retracted_total > 0
    for i in range(6):
        rid = f"r{i}"
        assert rows_of(out, rid) == expected_rows(prompt(90, seed=i), i * 7)
        assert [lp.top_ids[0] for lp in out.scores[rid]] == out.tokens[rid]
        # Positions of the streamed tokens: consecutive, none twice.
        assert [lp.logprob for lp in out.scores[rid]] == [float(90 + k) for k in range(len(out.tokens[rid]))]
