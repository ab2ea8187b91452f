"""The engine's step loop in process: a fake worker behind the channel, SGLang's log lines out."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog

from control_plane.config import ControlConfig
from control_plane.engine import Chunk, Done, Engine
from control_plane.request import RequestParams, SamplerSpec
from control_plane.scheduler.plan import StepPlan, StepResult, WorkerLimits
from control_plane.tokenizer import Tokenizer
from stepwise.embedded import resolve_model
from tests.control_plane.factories import make_config
from tests.control_plane.fake_worker import FakeWorker

pytestmark = pytest.mark.timeout(60)


class FakeChannel:
    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker
        self.closed = ""

    async def step(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(0)
        return self.worker.run(plan)

    async def close(self, reason: str) -> None:
        self.closed = reason


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("embedded"))


def _engine(tokenizer: Tokenizer, capacity: int = 4096, **scheduler: object) -> tuple[Engine, FakeChannel]:
    config = ControlConfig(model_dir=Path("."), scheduler=make_config(**scheduler), decode_log_interval=1)
    limits = WorkerLimits("w-test", capacity, 1, 2048, tokenizer.vocab_size, tokenizer.eos_token_ids)
    channel = FakeChannel(FakeWorker(capacity, vocab=tokenizer.vocab_size))
    return Engine(config, limits, tokenizer, channel), channel


async def _drain(events: asyncio.Queue, n: int = 1) -> list[Chunk | Done]:
    out: list[Chunk | Done] = []
    while sum(isinstance(e, Done) for e in out) < n:
        out.append(await events.get())
    return out


def _params(max_new: int, **kw: object) -> RequestParams:
    return RequestParams(max_new_tokens=max_new, sampler=SamplerSpec(temperature=0.0), ignore_eos=True, **kw)  # type: ignore[arg-type]


async def test_streams_tokens_and_logs_sglang_lines(tokenizer: Tokenizer) -> None:
    engine, channel = _engine(tokenizer)
    task = asyncio.create_task(engine.run())
    with structlog.testing.capture_logs() as logs:
        subs = [engine.submit(f"r{i}", tokenizer.encode("Once upon a time"), _params(5)) for i in range(3)]
        events = [await _drain(s.events) for s in subs]
    engine.stop()
    await task
    for stream in events:
        done = stream[-1]
        assert isinstance(done, Done) and done.completion_tokens == 5 and done.reason.kind.value == "length"
        assert sum(len(e.token_ids) for e in stream if isinstance(e, Chunk)) == 5
    lines = [entry["event"] for entry in logs]
    prefill = next(line for line in lines if line.startswith("Prefill batch"))
    assert prefill.startswith("Prefill batch, #new-seq: 3, #new-token: ")
    for field in (
        "#cached-token: ",
        "token usage: ",
        "#running-req: 0",
        "#queue-req: 0",
        "#pending-token: 0",
        "input throughput (token/s): ",
    ):
        assert field in prefill
    decode = next(line for line in lines if line.startswith("Decode batch"))
    for field in (
        "#running-req: 3",
        "#token: ",
        "token usage: ",
        "gen throughput (token/s): ",
        "#queue-req: 0",
    ):
        assert field in decode
    assert channel.closed  # the worker is told to shut down when the loop stops


async def test_stop_string_ends_the_request_and_frees_it_next_plan(tokenizer: Tokenizer) -> None:
    engine, channel = _engine(tokenizer)
    task = asyncio.create_task(engine.run())
    prompt = tokenizer.encode("The king")
    free = await _drain(engine.submit("free", prompt, _params(12)).events)
    text = "".join(e.text for e in free if isinstance(e, Chunk))
    stop = text[4:6]
    assert stop
    stopped = await _drain(engine.submit("stopped", prompt, _params(12, stop=(stop,))).events)
    engine.stop()
    await task
    got = "".join(e.text for e in stopped if isinstance(e, Chunk))
    done = stopped[-1]
    assert isinstance(done, Done) and done.reason.kind.value == "stop" and stop in done.reason.message
    assert got == text[: text.index(stop)]
    assert not channel.worker.seqs  # released in the plan after the stop


async def test_parallel_samples_finish_as_one_call(tokenizer: Tokenizer) -> None:
    engine, _ = _engine(tokenizer)
    task = asyncio.create_task(engine.run())
    sub = engine.submit("call", tokenizer.encode("Hello"), _params(4), n=3)
    events = await _drain(sub.events, n=3)
    engine.stop()
    await task
    assert sub.rids == ["call/0", "call/1", "call/2"]
    assert sorted(e.index for e in events if isinstance(e, Done)) == [0, 1, 2]
    assert not engine.knows("call")
