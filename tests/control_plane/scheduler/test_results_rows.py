"""A result's finish checks row by row (a few rows, results.FEW_ROWS) and as columns (more) decide the
same: every token streamed and every finish, on requests that end by length, EOS, their own stop token
ids, after min_new_tokens or ignoring EOS, and by an abort while running."""

from __future__ import annotations

import pytest

from control_plane.request import FinishReason
from control_plane.scheduler import results
from tests.control_plane.factories import EOS, make_scheduler, params, prompt, run
from tests.control_plane.fake_worker import FakeWorker

Outcome = tuple[dict[str, list[int]], dict[str, FinishReason]]


def _outcome(few_rows: int, requests: int, overlap: bool) -> Outcome:
    kinds = [
        params(12),
        params(40),
        params(40, min_new_tokens=9),
        params(30, ignore_eos=True),
        params(40, stop_token_ids=frozenset(range(100, 400))),
        params(40, stop_token_ids=frozenset(range(100, 400)), min_new_tokens=5),
    ]
    arrivals = [(i % 7, f"r{i}", prompt(8 + i % 5, seed=i), kinds[i % len(kinds)]) for i in range(requests)]

    def abort_one(sched, step: int) -> None:  # type: ignore[no-untyped-def]
        if step == 9:
            sched.abort("r3", FinishReason.abort("client went away"))  # ignores EOS: running then

    sched = make_scheduler(capacity=4096)
    before = results.FEW_ROWS
    results.FEW_ROWS = few_rows
    try:
        out = run(sched, FakeWorker(4096, eos=EOS, eos_every=5), arrivals, on_step=abort_one, overlap=overlap)
    finally:
        results.FEW_ROWS = before
    return out.tokens, out.finished


@pytest.mark.parametrize("requests", [4, 24])
@pytest.mark.parametrize("overlap", [False, True])
def test_row_by_row_and_columns_stream_and_finish_the_same(requests: int, overlap: bool) -> None:
    as_columns = _outcome(0, requests, overlap)
    by_row = _outcome(10_000, requests, overlap)
    assert by_row == as_columns
    tokens, finished = as_columns
    # The mix does what it is for: requests end every way, and some before their length.
    how = {reason.message.split(" ")[0] for reason in finished.values()}
    assert len(finished) == requests
    assert {"eos", "max_new_tokens", "client"} <= how and (requests < 5 or "stop" in how)
    assert any(len(t) < 12 for t in tokens.values())
