"""A grammar that could not be satisfied (issue 37 item 7): the worker sampled EOS for a sequence
whose matcher failed and named that sample in `StepResult.grammar_failed`; the scheduler ends it
with finish reason grammar_unsatisfiable, not stop, and a recording of it replays exactly."""

from __future__ import annotations

import dataclasses

import numpy as np

from control_plane.record import codec
from control_plane.record.entries import ApplyResult
from control_plane.record.replay import first_difference
from control_plane.request import FinishKind, FinishReason
from protos.worker import StepResult
from tests.control_plane.factories import EOS, add, finishes, make_scheduler, params, prompt
from tests.control_plane.fake_worker import FakeWorker


def _finish_after(failed_at: list[int], n: int = 2) -> dict[str, FinishReason]:
    """Requests r0..r{n-1} prefill, then decode once with EOS sampled for every one of them; the
    samples at `failed_at` are said to have failed their grammar."""
    sched = make_scheduler()
    worker = FakeWorker(4096, eos=EOS, eos_every=0)
    for i in range(n):
        add(sched, f"r{i}", prompt(12, i), params(30))
    ended: dict[str, FinishReason] = {}
    for step in range(2):
        plan = sched.next_plan()
        assert plan is not None
        result = worker.run(plan)
        if step == 1:
            eos = np.full(len(result.token_ids), EOS, dtype=np.int32)
            result = dataclasses.replace(
                result, token_ids=eos, grammar_failed=np.asarray(failed_at, np.int32)
            )
        sched.apply_result(result)
        ended.update(finishes(sched.take_updates()))
    return ended


def test_a_sample_whose_grammar_failed_ends_grammar_unsatisfiable_and_the_others_stop() -> None:
    ended = _finish_after([1])
    assert ended["r0"] == FinishReason.stop("eos")
    assert ended["r1"].kind is FinishKind.GRAMMAR_UNSATISFIABLE
    assert "could not be satisfied" in ended["r1"].message


def test_without_grammar_failed_eos_is_stop() -> None:
    assert {r.kind for r in _finish_after([]).values()} == {FinishKind.STOP}


def test_a_recorded_result_keeps_grammar_failed() -> None:
    entry = ApplyResult(
        StepResult(5, np.asarray([EOS, EOS], np.int32), grammar_failed=np.asarray([1], np.int32))
    )
    assert first_difference(entry, codec.decode(codec.encode(entry))) is None
    assert first_difference(
        entry, ApplyResult(dataclasses.replace(entry.result, grammar_failed=np.zeros(0, np.int32)))
    )
