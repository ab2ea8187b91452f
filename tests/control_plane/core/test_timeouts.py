"""Request timeouts (docs/scheduler.md#step-loop step 2, docs/scheduler.md#intake) through the engine's step
loop, in process.

The waiting timeout counts from the latest (re-)entry into the waiting queue and applies to every
waiting request, retracted ones included; the running timeout applies to the running batch and is an
abort of a running request: the request is decoded once more, then its KV is cached like any finished
request's (docs/scheduler.md#aborts; SGLang:
`scheduler.py:_abort_on_waiting_timeout`, `_abort_on_running_timeout`; `wait_queue_entry_time` is
overwritten on every re-queue, `_add_request_to_queue`).
"""

from __future__ import annotations

import asyncio

import pytest

from control_plane.core.engine import Engine
from control_plane.core.timeouts import RUNNING_TIMEOUT, WAITING_TIMEOUT
from control_plane.request import RequestParams
from control_plane.tokenizer import Tokenizer
from protos.worker import SamplerParams
from stepwise.models import resolve_model
from tests.control_plane.fake_core import FakeHub, finished, make_engine, submit

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("embedded"))


def _engine(
    tokenizer: Tokenizer, step_s: float = 0.02, test_retract: bool = False, **timeouts: float
) -> tuple[Engine, FakeHub]:
    engine, _, hub = make_engine(
        tokenizer.vocab_size, step_s=step_s, test_retract=test_retract, control=dict(timeouts)
    )
    return engine, hub


def _params(max_new: int) -> RequestParams:
    return RequestParams(max_new_tokens=max_new, sampler=SamplerParams(temperature=0.0), ignore_eos=True)


@pytest.mark.parametrize("overlap", [True, False])
async def test_the_waiting_timeout_counts_from_the_latest_reentry(
    tokenizer: Tokenizer, overlap: bool
) -> None:
    """Steps take 150 ms and TEST_RETRACT retracts one of two running requests every third forward.
    The retracted one is back in the waiting queue for the whole step that follows (150 ms > the
    100 ms waiting timeout), so it times out though it was admitted before. Before, the waiting
    timeout applied only to requests never admitted, and both ran to their length."""
    engine, hub = _engine(tokenizer, step_s=0.15, waiting_timeout_s=0.1, test_retract=True)
    engine.pipeline.depth = 2 if overlap else 1
    task = asyncio.create_task(engine.run())
    uids = [submit(engine, f"r{i}", [5 + i, 6, 7, 8, 9], _params(12))[0] for i in range(2)]
    streams = await finished(hub, uids, timeout=30)
    engine.stop()
    await task
    reasons = sorted((s.finished.kind.value, s.finished.message) for s in streams if s.finished)
    assert reasons == [("abort", WAITING_TIMEOUT), ("length", "max_new_tokens")]
    timed_out = next(s for s in streams if s.finished and s.finished.message == WAITING_TIMEOUT)
    assert timed_out.tokens, "it had run before it was retracted"


async def test_the_running_timeout_finishes_and_caches_the_request(tokenizer: Tokenizer) -> None:
    engine, hub = _engine(tokenizer, running_timeout_s=0.2)
    task = asyncio.create_task(engine.run())
    (stream,) = await finished(hub, submit(engine, "slow", [5, 6, 7, 8, 9], _params(500)), timeout=30)
    # The stream ends at the timeout; the request leaves the scheduler one decode later.
    async with asyncio.timeout(30):
        while not engine.scheduler.is_idle:
            await asyncio.sleep(0.01)
    engine.stop()
    await task
    assert stream.finished is not None
    assert (stream.finished.kind.value, stream.finished.message) == ("abort", RUNNING_TIMEOUT)
    assert 0 < len(stream.tokens) < 500
    # Prompt and every streamed output are cached in the tree (freed at once, the outputs were not).
    assert engine.scheduler.kv.evictable_size() >= 5 + len(stream.tokens)
