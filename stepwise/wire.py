"""The worker link without a network: a plan goes through both planes' codecs to an executor and back.

Used by `simulate` and `replay worker`, so what they exercise is the wire format itself: the
control plane's plan_to_proto, the data plane's plan_from_proto, and the same for the result.
"""

from __future__ import annotations

from typing import Protocol

from control_plane import codec as control_codec
from control_plane.scheduler.plan import StepPlan, StepResult
from data_plane import codec as data_codec
from data_plane import messages


class Executor(Protocol):
    def execute(self, plan: messages.StepPlan) -> messages.StepResult: ...


def step_through_wire(executor: Executor, plan: StepPlan) -> StepResult:
    wire_plan = control_codec.plan_to_proto(plan).plan
    result = executor.execute(data_codec.plan_from_proto(wire_plan))
    return control_codec.result_from_proto(data_codec.result_to_proto(result).result)
