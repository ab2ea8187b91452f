"""check_result: a worker's result must carry one token per sampled entry of its plan, in the vocabulary."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from control_plane.core.worker_checks import WorkerFault, check_result
from protos.worker import StepPlan, StepResult
from tests.control_plane.factories import FakeWorker, make_scheduler, params, prompt

VOCAB = 1000


def _mixed_plan() -> tuple[StepPlan, StepResult]:
    """A plan with a middle chunk (not sampled), a whole prefill and decodes, and its honest result."""
    sched = make_scheduler(chunked_prefill_size=32, enable_mixed_chunk=True)
    worker = FakeWorker(4096)
    for i in range(2):
        sched.add_request(f"short{i}", prompt(6, i), params(20, ignore_eos=True))
    for _ in range(2):
        plan = sched.next_plan()
        assert plan is not None
        sched.apply_result(worker.run(plan))
    sched.add_request("long", prompt(100, 7), params(4))
    sched.add_request("next", prompt(5, 8), params(4))
    plan = sched.next_plan()
    assert plan is not None and len(plan.decodes) == 2 and not plan.extends.sample.all()
    return plan, worker.run(plan)


def test_an_honest_result_passes() -> None:
    plan, result = _mixed_plan()
    assert len(result.token_ids) == int(plan.extends.sample.sum()) + len(plan.decodes)
    check_result(plan, result, VOCAB)


@pytest.mark.parametrize("change", [1, -1])
def test_a_token_more_or_fewer_than_sampled_is_a_fault(change: int) -> None:
    plan, result = _mixed_plan()
    n = len(result.token_ids)
    tokens = np.resize(result.token_ids, n + change)
    message = rf"carries {n + change} tokens, not one for each of the {n} sequences the plan sampled"
    with pytest.raises(WorkerFault, match=message):
        check_result(plan, dataclasses.replace(result, token_ids=tokens), VOCAB)


def test_a_token_outside_the_vocabulary_is_a_fault() -> None:
    plan, result = _mixed_plan()
    tokens = result.token_ids.copy()
    tokens[-1] = VOCAB
    with pytest.raises(WorkerFault, match=rf"token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"):
        check_result(plan, dataclasses.replace(result, token_ids=tokens), VOCAB)


def test_a_result_for_another_step_is_a_fault() -> None:
    plan, result = _mixed_plan()
    with pytest.raises(WorkerFault, match=f"result for step {plan.step_id + 1} while step {plan.step_id}"):
        check_result(plan, dataclasses.replace(result, step_id=plan.step_id + 1), VOCAB)
