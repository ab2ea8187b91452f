"""The engine's step loop in process: a fake worker behind the channel, SGLang's log lines out."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
import structlog

from control_plane import engine as engine_module
from control_plane import failover as failover_module
from control_plane.config import ControlConfig
from control_plane.engine import Engine
from control_plane.request import RequestParams, SamplerSpec
from control_plane.scheduler.plan import StepPlan, StepResult, WorkerLimits
from control_plane.streams import Chunk, Done
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


def _tokens(events: list[Chunk | Done]) -> list[int]:
    return [t for e in events if isinstance(e, Chunk) for t in e.token_ids]


async def test_a_fault_of_ours_restarts_the_scheduler_and_requests_continue(tokenizer: Tokenizer) -> None:
    """One exception out of next_plan mid-stream: the loop survives, the worker is told to forget
    everything, and every stream still gets exactly the tokens a fault-free run gives."""
    prompts = [tokenizer.encode(p) for p in ("Once upon a time", "The king said", "We")]
    clean, _ = _engine(tokenizer)
    task = asyncio.create_task(clean.run())
    want = [
        _tokens(await _drain(clean.submit(f"r{i}", p, _params(12)).events)) for i, p in enumerate(prompts)
    ]
    clean.stop()
    await task

    engine, channel = _engine(tokenizer)
    faults = {"left": 1}
    next_plan = engine.scheduler.next_plan

    def flaky() -> StepPlan | None:
        if engine.steps >= 4 and faults["left"]:
            faults["left"] -= 1
            raise RuntimeError("a bug in the scheduler")
        return next_plan()

    engine.scheduler.next_plan = flaky  # type: ignore[method-assign]
    task = asyncio.create_task(engine.run())
    with structlog.testing.capture_logs() as logs:
        subs = [engine.submit(f"r{i}", p, _params(12)) for i, p in enumerate(prompts)]
        got = [await _drain(s.events) for s in subs]
    assert faults["left"] == 0 and engine.scheduler.next_plan is not flaky  # a fresh scheduler
    assert [_tokens(events) for events in got] == want
    assert all(isinstance(e[-1], Done) and e[-1].reason.kind.value == "length" for e in got)
    fault = next(entry for entry in logs if "step loop fault" in entry["event"])
    assert fault["log_level"] == "error" and isinstance(fault["exc_info"], RuntimeError)
    # The engine goes on serving, and the worker holds exactly what the books say.
    after = await _drain(engine.submit("after", prompts[0], _params(3)).events)
    assert isinstance(after[-1], Done) and after[-1].completion_tokens == 3
    engine.stop()
    await task
    assert not channel.worker.seqs


async def test_a_request_that_keeps_faulting_ends_with_an_abort(tokenizer: Tokenizer) -> None:
    engine, _ = _engine(tokenizer)
    broken = {"on": True}

    def apply_fails(result: StepResult) -> None:
        raise RuntimeError("apply_result bug")

    engine.scheduler.apply_result = apply_fails  # type: ignore[method-assign]
    make = failover_module.make_scheduler

    def make_broken(config, limits):  # type: ignore[no-untyped-def]
        sched = make(config, limits)
        if broken["on"]:
            sched.apply_result = apply_fails  # type: ignore[method-assign]
        return sched

    failover_module.make_scheduler = make_broken  # type: ignore[assignment]
    try:
        task = asyncio.create_task(engine.run())
        events = await asyncio.wait_for(_drain(engine.submit("doomed", [5, 6, 7], _params(5)).events), 10)
        done = events[-1]
        assert isinstance(done, Done) and done.reason.kind.value == "abort"
        assert "internal error" in done.reason.message
        broken["on"] = False
        engine.scheduler = make(engine.config, engine.limits)
        after = await asyncio.wait_for(_drain(engine.submit("fine", [5, 6, 7], _params(3)).events), 10)
        assert isinstance(after[-1], Done) and after[-1].completion_tokens == 3
        engine.stop()
        await task
    finally:
        failover_module.make_scheduler = make  # type: ignore[assignment]


async def test_arrivals_left_in_the_inbox_when_the_engine_stops_are_answered(tokenizer: Tokenizer) -> None:
    engine, _ = _engine(tokenizer)
    sub = engine.submit("late", [5, 6, 7], _params(3))
    engine.stop()
    await engine.run()
    await asyncio.wait_for(sub.accepted, 1)
    done = await asyncio.wait_for(sub.events.get(), 1)
    assert isinstance(done, Done) and done.reason.kind.value == "abort"


async def test_an_arrival_whose_client_left_is_withdrawn(tokenizer: Tokenizer) -> None:
    engine, channel = _engine(tokenizer)
    sub = engine.submit("gone", [5, 6, 7], _params(50))
    sub.accepted.cancel()  # the Generate call was cancelled while waiting to be accepted
    task = asyncio.create_task(engine.run())
    await asyncio.sleep(0.05)
    assert not engine.knows("gone") and not engine.scheduler.requests
    kept = await _drain(engine.submit("kept", [5, 6, 7], _params(2)).events)
    assert isinstance(kept[-1], Done) and kept[-1].completion_tokens == 2
    engine.stop()
    await task
    assert not channel.worker.seqs


def test_largest_seed_wraps_for_parallel_samples() -> None:
    """Seeds are uint64 on the wire: sample 1 of seed 2^64-1 gets 0, not an overflow in the codec."""
    params = RequestParams(max_new_tokens=3, sampler=SamplerSpec(seed=2**64 - 1))
    seeds = [engine_module._sample_params(params, i, 2, "g").sampler.seed for i in range(2)]
    assert seeds == [2**64 - 1, 0]


async def test_the_idle_pool_check_runs_in_slices_and_yields_between_them(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "IDLE_CHECK_BUDGET", 1)
    slices: list[int] = []
    ticks = {"n": 0}
    run = engine_module.PoolCheck.run

    def counted(self, budget: int) -> bool:  # type: ignore[no-untyped-def]
        slices.append(ticks["n"])
        return run(self, budget)

    monkeypatch.setattr(engine_module.PoolCheck, "run", counted)

    async def ticker() -> None:
        while True:
            ticks["n"] += 1
            await asyncio.sleep(0)

    engine, _ = _engine(tokenizer)
    task = asyncio.create_task(engine.run())
    tick = asyncio.create_task(ticker())
    await _drain(engine.submit("r", tokenizer.encode("Once upon a time"), _params(6)).events)
    while engine._pool_dirty:
        await asyncio.sleep(0.01)
    engine.stop()
    await task
    tick.cancel()
    assert len(slices) > 3, slices
    # Other coroutines ran between consecutive slices: the loop was never held for the whole check.
    assert all(b > a for a, b in itertools.pairwise(slices))
