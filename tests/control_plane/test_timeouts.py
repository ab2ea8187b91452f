"""Request timeouts (SCHEDULER.md §1.3 step 2, §1.5) through the engine's step loop, in process.

The waiting timeout counts from the latest (re-)entry into the waiting queue and applies to every
waiting request, retracted ones included; the running timeout applies to the running batch and is a
deferred finish: the request's KV is cached like any finished request's (SGLang:
`scheduler.py:_abort_on_waiting_timeout`, `_abort_on_running_timeout`; `wait_queue_entry_time` is
overwritten on every re-queue, `_add_request_to_queue`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from control_plane.config import ControlConfig
from control_plane.engine import Engine
from control_plane.request import RequestParams, SamplerSpec
from control_plane.scheduler.plan import StepPlan, StepResult, WorkerLimits
from control_plane.streams import Done
from control_plane.timeouts import RUNNING_TIMEOUT, WAITING_TIMEOUT
from control_plane.tokenizer import Tokenizer
from stepwise.embedded import resolve_model
from tests.control_plane.factories import make_config
from tests.control_plane.fake_worker import FakeWorker

pytestmark = pytest.mark.timeout(60)


class SlowChannel:
    """A fake worker whose every step takes `step_s` of wall time."""

    def __init__(self, worker: FakeWorker, step_s: float) -> None:
        self.worker, self.step_s = worker, step_s

    async def step(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(self.step_s)
        return self.worker.run(plan)

    async def close(self, reason: str) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("embedded"))


def _engine(
    tokenizer: Tokenizer, capacity: int, step_s: float = 0.02, test_retract: bool = False, **timeouts: float
) -> Engine:
    scheduler = make_config(test_retract=test_retract)
    config = ControlConfig(model_dir=Path("."), scheduler=scheduler, **timeouts)  # type: ignore[arg-type]
    limits = WorkerLimits("w-timeouts", capacity, 1, 2048, tokenizer.vocab_size, tokenizer.eos_token_ids)
    worker = FakeWorker(capacity, vocab=tokenizer.vocab_size)
    return Engine(config, limits, tokenizer, SlowChannel(worker, step_s))


def _params(max_new: int) -> RequestParams:
    return RequestParams(max_new_tokens=max_new, sampler=SamplerSpec(temperature=0.0), ignore_eos=True)


async def _done(events: asyncio.Queue) -> Done:
    while not isinstance(event := await events.get(), Done):
        pass
    return event


async def test_the_waiting_timeout_counts_from_the_latest_reentry(tokenizer: Tokenizer) -> None:
    """Steps take 150 ms and TEST_RETRACT retracts one of two running requests every third forward.
    The retracted one is back in the waiting queue for the whole step that follows (150 ms > the
    100 ms waiting timeout), so it times out though it was admitted before. Before, the waiting
    timeout applied only to requests never admitted, and both ran to their length."""
    engine = _engine(tokenizer, 4096, step_s=0.15, waiting_timeout_s=0.1, test_retract=True)
    task = asyncio.create_task(engine.run())
    subs = [engine.submit(f"r{i}", [5 + i, 6, 7, 8, 9], _params(12)) for i in range(2)]
    done = await asyncio.wait_for(asyncio.gather(*(_done(s.events) for s in subs)), 30)
    engine.stop()
    await task
    reasons = sorted((d.reason.kind.value, d.reason.message) for d in done)
    assert reasons == [("abort", WAITING_TIMEOUT), ("length", "max_new_tokens")]
    timed_out = next(d for d in done if d.reason.message == WAITING_TIMEOUT)
    assert timed_out.completion_tokens > 0, "it had run before it was retracted"


async def test_the_running_timeout_finishes_and_caches_the_request(tokenizer: Tokenizer) -> None:
    engine = _engine(tokenizer, 4096, running_timeout_s=0.2)
    task = asyncio.create_task(engine.run())
    sub = engine.submit("slow", [5, 6, 7, 8, 9], _params(500))
    done = await asyncio.wait_for(_done(sub.events), 30)
    engine.stop()
    await task
    assert (done.reason.kind.value, done.reason.message) == ("abort", RUNNING_TIMEOUT)
    assert 0 < done.completion_tokens < 500
    # A deferred finish caches prompt and output in the tree; an abort would have freed the output.
    assert engine.scheduler.kv.evictable_size() >= 5 + done.completion_tokens - 1
