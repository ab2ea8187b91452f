"""The worker link without a network: a plan goes through the link's codec to an executor and back.

Used by `simulate` and `replay worker`, so what they exercise is the wire format itself. Two forms:

- `step_through_wire(executor, plan)`: stateless, each plan on its own with its decode set in full;
- `WireLink(executor).step(plan)`: one link's PlanEncoder and PlanDecoder, so the decode set travels
  as a delta against the previous decode plan, as it does between real processes. Feed it every
  plan of a session in order.
"""

from __future__ import annotations

from typing import Protocol

from protos import worker_codec
from protos.stepwise.v1 import worker_pb2
from protos.worker import StepPlan, StepResult, sampled_count


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


def step_through_wire(executor: Executor, plan: StepPlan) -> StepResult:
    wire_plan = _wire(worker_codec.plan_to_proto(plan).plan)
    return _answer(executor, worker_codec.plan_from_proto(wire_plan), plan)


class WireLink:
    """Both ends of one worker link in one process, serialised bytes included."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.encoder = worker_codec.PlanEncoder()
        self.decoder = worker_codec.PlanDecoder()

    def step(self, plan: StepPlan) -> StepResult:
        wire_plan = _wire(self.encoder.encode(plan).plan)
        return _answer(self.executor, self.decoder.plan(wire_plan), plan)


def _wire(plan: worker_pb2.StepPlan) -> worker_pb2.StepPlan:
    """The plan as the worker would parse it off the stream."""
    return worker_pb2.StepPlan.FromString(plan.SerializeToString())


def _answer(executor: Executor, worker_plan: StepPlan, plan: StepPlan) -> StepResult:
    result = worker_codec.result_to_proto(executor.execute(worker_plan)).result
    return worker_codec.result_from_proto(result, sampled_count(plan))
