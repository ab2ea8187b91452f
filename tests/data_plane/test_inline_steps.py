"""Which steps run on the worker's event loop thread: short CPU steps do (a forward in a second
thread fights the loop for the GIL all step long), long ones and every CUDA step run in a thread so
the loop keeps reading the stream and answering health checks."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from data_plane.executor import INLINE_MAX_TOKENS, Executor
from data_plane.kv_pool import KvPool
from data_plane.link import Link
from data_plane.models.llama import LlamaModel
from data_plane.session import _Arrived, _Inbox, _run_plans
from data_plane.sim import SimExecutor
from protos.worker import KvReport, Shutdown, StepPlan, StepResult
from tests.data_plane.factories import Extend, SlotAllocator, make_plan, new_seq


def extend_plan(step_id: int, tokens: int) -> StepPlan:
    slots = SlotAllocator(4096, page_size=1, seed=step_id)
    return make_plan(
        step_id,
        new_seqs=[new_seq(step_id)],
        extends=[Extend(step_id, 0, [5] * tokens, slots.alloc(step_id, tokens))],
    )


def test_a_cpu_executor_runs_short_steps_inline_and_long_ones_in_a_thread(our_model: LlamaModel) -> None:
    executor = Executor(our_model, KvPool(our_model.config, 64, torch.float32, our_model.device))
    assert executor.runs_inline(extend_plan(1, INLINE_MAX_TOKENS))
    assert not executor.runs_inline(extend_plan(2, INLINE_MAX_TOKENS + 1))


def test_a_cuda_executor_never_runs_inline(our_model: LlamaModel) -> None:
    executor = Executor(our_model, KvPool(our_model.config, 64, torch.float32, our_model.device))
    executor.device = torch.device("cuda")  # only the policy is asked; nothing runs
    assert not executor.runs_inline(extend_plan(1, 1))


def test_a_sleeping_simulator_never_blocks_the_loop() -> None:
    assert SimExecutor(1024, 100, 0).runs_inline(extend_plan(1, 4))
    assert not SimExecutor(1024, 100, 0, sleep=True).runs_inline(extend_plan(1, 4))


@dataclass
class ThreadRecorder:
    """Answers every plan at once and notes the thread it ran on; plans with step_id >= 100 are long."""

    threads: dict[int, int] = field(default_factory=dict)

    def runs_inline(self, plan: StepPlan) -> bool:
        return plan.step_id < 100

    def execute(self, plan: StepPlan) -> StepResult:
        self.threads[plan.step_id] = threading.get_ident()
        return StepResult(step_id=plan.step_id, token_ids=np.zeros(0, np.int64), kv=KvReport(0, 0, 0, 0, 0))

    def reset(self) -> None:
        pass


class RecordingCall:
    def __init__(self) -> None:
        self.written: list[object] = []

    async def write(self, message: object) -> None:
        self.written.append(message)

    async def done_writing(self) -> None:
        pass


@pytest.mark.timeout(10)
async def test_the_session_runs_what_the_executor_calls_short_on_the_loop_thread() -> None:
    executor, call = ThreadRecorder(), RecordingCall()
    inbox: _Inbox = asyncio.Queue()
    for step_id in (1, 100, 2):
        inbox.put_nowait(_Arrived(make_plan(step_id), 0.0))
    inbox.put_nowait(Shutdown("done"))
    await _run_plans(executor, call, inbox, Link(), None)  # type: ignore[arg-type]
    loop_thread = threading.get_ident()
    assert executor.threads[1] == executor.threads[2] == loop_thread
    assert executor.threads[100] != loop_thread
    assert len(call.written) == 3  # every result went out, in order, before the session ended
