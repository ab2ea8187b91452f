"""The engine's step loop in process: a fake worker behind the channel, a hub that records what is
published, SGLang's log lines out."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
import structlog

from control_plane.core import admission
from control_plane.core import books as books_module
from control_plane.core import engine as engine_module
from control_plane.core.drain import DRAINED, Departure
from control_plane.core.fleet import Fleet as WorkerFleet
from control_plane.core.fleet import Router
from control_plane.core.handover import WorkerGone
from control_plane.core.inbox import LiveSample, Orphan, Verdict
from control_plane.link import UID_LINK_SHIFT
from control_plane.request import FinishReason, RequestParams
from control_plane.tokenizer import Tokenizer
from protos.worker import SamplerParams, StepPlan, StepResult
from stepwise.models import resolve_model
from tests.control_plane.fake_core import FakeChannel, FakeHub, finished, make_engine, submit

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("embedded"))


def _engine(tokenizer: Tokenizer, **kw: object) -> tuple[engine_module.Engine, FakeChannel, FakeHub]:
    return make_engine(tokenizer.vocab_size, tokenizer.eos_token_ids, **kw)  # type: ignore[arg-type]


async def _released(channel: FakeChannel, timeout: float = 5.0) -> None:
    """The worker forgets finished sequences in the plan after their finish: wait for it."""
    async with asyncio.timeout(timeout):
        while channel.worker.seqs:
            await asyncio.sleep(0.001)


def _params(max_new: int, **kw: object) -> RequestParams:
    return RequestParams(
        max_new_tokens=max_new, sampler=SamplerParams(temperature=0.0), ignore_eos=True, **kw
    )  # type: ignore[arg-type]


async def test_streams_tokens_and_logs_sglang_lines(tokenizer: Tokenizer) -> None:
    engine, channel, hub = _engine(tokenizer)
    task = asyncio.create_task(engine.run())
    with structlog.testing.capture_logs() as logs:
        uids = [
            submit(engine, f"r{i}", tokenizer.encode("Once upon a time"), _params(5))[0] for i in range(3)
        ]
        streams = await finished(hub, uids)
    engine.stop()
    await task
    for uid, stream in zip(uids, streams, strict=True):
        assert hub.verdicts[uid] == (Verdict.ACCEPTED, "")
        assert stream.admitted and len(stream.tokens) == 5
        assert stream.finished is not None and stream.finished.kind.value == "length"
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


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
async def test_the_next_plan_goes_out_before_the_last_step_is_published(
    tokenizer: Tokenizer, overlap: bool
) -> None:
    """Two plans in flight with overlap (one without), and every publish happens after the plan that
    follows the published step was sent: publishing never delays the worker."""
    log: list[tuple[str, int]] = []
    engine, channel, hub = _engine(tokenizer, overlap=overlap, log=log)
    task = asyncio.create_task(engine.run())
    await finished(hub, submit(engine, "r", [5, 6, 7], _params(12)))
    engine.stop()
    await task
    assert channel.max_in_flight == (2 if overlap else 1)
    received = 0
    for i, (kind, value) in enumerate(log):
        if kind == "receive":
            received = value
        elif kind == "publish" and received < len([e for e in log if e[0] == "send"]):
            sent_before = [v for k, v in log[:i] if k == "send"]
            assert max(sent_before) > received, f"step {received} published before the next plan was sent"


async def test_a_frontend_stop_finishes_the_request_and_frees_it_next_plan(tokenizer: Tokenizer) -> None:
    engine, channel, hub = _engine(tokenizer)
    task = asyncio.create_task(engine.run())
    (uid,) = submit(engine, "stopped", [5, 6, 7], _params(500))
    while len(hub.stream(uid).tokens) < 4:
        await asyncio.sleep(0.001)
    assert engine.stop_sample(uid, FinishReason.stop("stop string 'x'"))
    (stream,) = await finished(hub, [uid])
    assert stream.finished is not None and stream.finished.message == "stop string 'x'"
    assert len(stream.tokens) < 500
    await _released(channel)  # in a plan after the stop
    engine.stop()
    await task
    # Finished, not aborted: its prompt and output went into the prefix cache.
    assert engine.scheduler.kv.evictable_size() >= 3


async def test_parallel_samples_finish_as_one_call(tokenizer: Tokenizer) -> None:
    engine, _, hub = _engine(tokenizer)
    task = asyncio.create_task(engine.run())
    uids = submit(engine, "call", tokenizer.encode("Hello"), _params(4), n=3)
    assert engine.knows("call") and engine.knows("call/2")
    streams = await finished(hub, uids)
    engine.stop()
    await task
    assert [len(s.tokens) for s in streams] == [4, 4, 4]
    assert hub.verdicts == {uids[0]: (Verdict.ACCEPTED, "")}  # one verdict for the call
    assert not engine.knows("call")


async def test_a_dead_frontends_requests_are_aborted_and_no_others(tokenizer: Tokenizer) -> None:
    engine, channel, hub = _engine(tokenizer)
    task = asyncio.create_task(engine.run())
    doomed = [submit(engine, f"d{i}", [5, 6, 7], _params(500), link=4)[0] for i in range(2)]
    kept = submit(engine, "k", [5, 6, 7], _params(20), link=5)
    while not all(hub.stream(u).tokens for u in doomed):
        await asyncio.sleep(0.001)
    assert engine.abort_link(4, "its frontend went away") == 2
    streams = await finished(hub, [*doomed, *kept])
    assert all(s.finished is not None and s.finished.kind.value == "abort" for s in streams[:2])
    assert streams[2].finished is not None and len(streams[2].tokens) == 20
    await _released(channel)
    engine.stop()
    await task
    assert all(uid >> UID_LINK_SHIFT == 4 for uid in doomed)


def _tokens(hub: FakeHub, uids: list[int]) -> list[list[int]]:
    return [hub.stream(uid).tokens for uid in uids]


async def test_a_fault_of_ours_restarts_the_scheduler_and_requests_continue(tokenizer: Tokenizer) -> None:
    """One exception out of next_plan mid-stream, with plans in flight: the loop survives, the worker
    is told to forget everything, and every stream still gets exactly the tokens a fault-free run
    gives."""
    prompts = [tokenizer.encode(p) for p in ("Once upon a time", "The king said", "We")]
    clean, _, clean_hub = _engine(tokenizer)
    task = asyncio.create_task(clean.run())
    uids = [submit(clean, f"r{i}", p, _params(12))[0] for i, p in enumerate(prompts)]
    await finished(clean_hub, uids)
    want = _tokens(clean_hub, uids)
    clean.stop()
    await task

    engine, channel, hub = _engine(tokenizer)
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
        uids = [submit(engine, f"r{i}", p, _params(12))[0] for i, p in enumerate(prompts)]
        streams = await finished(hub, uids)
    assert faults["left"] == 0 and engine.scheduler.next_plan is not flaky  # a fresh scheduler
    assert _tokens(hub, uids) == want
    assert all(s.finished is not None and s.finished.kind.value == "length" for s in streams)
    fault = next(entry for entry in logs if "step loop fault" in entry["event"])
    assert fault["log_level"] == "error" and isinstance(fault["exc_info"], RuntimeError)
    # The engine goes on serving, and the worker holds exactly what the books say.
    (after,) = await finished(hub, submit(engine, "after", prompts[0], _params(3)))
    assert len(after.tokens) == 3
    await _released(channel)
    engine.stop()
    await task
    assert engine.books.kv_mismatches == 0


async def test_a_request_that_keeps_faulting_ends_with_an_abort(tokenizer: Tokenizer) -> None:
    engine, _, hub = _engine(tokenizer)
    broken = {"on": True}

    def apply_fails(result: StepResult) -> None:
        raise RuntimeError("apply_result bug")

    engine.scheduler.apply_result = apply_fails  # type: ignore[method-assign]
    make = engine_module.make_scheduler

    def make_broken(config, limits):  # type: ignore[no-untyped-def]
        sched = make(config, limits)
        if broken["on"]:
            sched.apply_result = apply_fails  # type: ignore[method-assign]
        return sched

    engine_module.make_scheduler = make_broken  # type: ignore[assignment]
    try:
        task = asyncio.create_task(engine.run())
        (doomed,) = await finished(hub, submit(engine, "doomed", [5, 6, 7], _params(5)))
        assert doomed.finished is not None and doomed.finished.kind.value == "abort"
        assert "internal error" in doomed.finished.message
        broken["on"] = False
        engine.scheduler = make(engine.config, engine.limits)
        engine.pipeline.forget()
        (fine,) = await finished(hub, submit(engine, "fine", [5, 6, 7], _params(3)))
        assert len(fine.tokens) == 3
        engine.stop()
        await task
    finally:
        engine_module.make_scheduler = make  # type: ignore[assignment]


async def test_arrivals_left_in_the_inbox_when_the_engine_stops_are_answered(tokenizer: Tokenizer) -> None:
    engine, _, hub = _engine(tokenizer)
    (uid,) = submit(engine, "late", [5, 6, 7], _params(3))
    engine.stop()
    await engine.run()
    assert hub.verdicts[uid][0] is Verdict.ACCEPTED
    (stream,) = await finished(hub, [uid], timeout=1)
    assert stream.finished is not None and stream.finished.kind.value == "abort"


async def test_an_arrival_whose_client_left_is_withdrawn(tokenizer: Tokenizer) -> None:
    engine, channel, hub = _engine(tokenizer)
    (gone,) = submit(engine, "gone", [5, 6, 7], _params(50))
    assert engine.abort("gone", "cancelled by the client")  # before the loop saw the arrival
    task = asyncio.create_task(engine.run())
    (stream,) = await finished(hub, [gone])
    assert stream.finished is not None and stream.finished.kind.value == "abort" and not stream.tokens
    assert not engine.knows("gone") and not engine.scheduler.requests
    (kept,) = await finished(hub, submit(engine, "kept", [5, 6, 7], _params(2)))
    assert len(kept.tokens) == 2
    await _released(channel)
    engine.stop()
    await task


async def test_an_unmeetable_objective_is_refused_as_such(tokenizer: Tokenizer) -> None:
    """Its own verdict (RESOURCE_EXHAUSTED on the wire, like a full queue), so the tenant book counts
    the refusal under `ttft_slo_ms`."""
    engine, _, hub = _engine(tokenizer, slo_cost=(0.01, 0.001, 0.0, 0.0))
    (uid,) = submit(engine, "hasty", [5, 6, 7], _params(5, ttft_slo_ms=1.0))
    engine._drain_inbox()
    verdict, message = hub.verdicts[uid]
    assert verdict is Verdict.SLO_UNMEETABLE and message.startswith("ttft_slo_ms:")


async def test_a_refused_arrival_gets_its_verdict_and_nothing_else(tokenizer: Tokenizer) -> None:
    engine, _, hub = _engine(tokenizer, max_queued_requests=1)
    first = submit(engine, "one", [5, 6, 7], _params(50))
    refused = submit(engine, "two", [5, 6, 7], _params(50), n=2)
    engine._drain_inbox()  # both reach the scheduler in one turn: the queue holds one
    assert hub.verdicts[first[0]][0] is Verdict.ACCEPTED
    verdict, message = hub.verdicts[refused[0]]
    assert verdict is Verdict.QUEUE_FULL and "queue is full" in message
    assert not engine.knows("two") and refused[0] not in hub.streams
    assert set(engine.scheduler.requests) == {"one"}


def test_largest_seed_wraps_for_parallel_samples() -> None:
    """Seeds are uint64 on the wire: sample 1 of seed 2^64-1 gets 0, not an overflow in the codec."""
    params = RequestParams(max_new_tokens=3, sampler=SamplerParams(temperature=1.0, seed=2**64 - 1))
    seeds = [admission.sample_params(params, i, 2, "g").sampler.seed for i in range(2)]
    assert seeds == [2**64 - 1, 0]


async def test_the_idle_pool_check_runs_in_slices_and_yields_between_them(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(books_module, "IDLE_CHECK_BUDGET", 1)
    slices: list[int] = []
    ticks = {"n": 0}
    run = books_module.PoolCheck.run

    def counted(self, budget: int) -> bool:  # type: ignore[no-untyped-def]
        slices.append(ticks["n"])
        return run(self, budget)

    monkeypatch.setattr(books_module.PoolCheck, "run", counted)

    async def ticker() -> None:
        while True:
            ticks["n"] += 1
            await asyncio.sleep(0)

    engine, _, hub = _engine(tokenizer)
    task = asyncio.create_task(engine.run())
    tick = asyncio.create_task(ticker())
    await finished(hub, submit(engine, "r", tokenizer.encode("Once upon a time"), _params(6)))
    while engine.books.pool_dirty:
        await asyncio.sleep(0.01)
    engine.stop()
    await task
    tick.cancel()
    assert len(slices) > 3, slices
    # Other coroutines ran between consecutive slices: the loop was never held for the whole check.
    assert all(b > a for a, b in itertools.pairwise(slices))


async def test_a_closed_engine_answers_what_still_reaches_it(tokenizer: Tokenizer) -> None:
    """The router passes an engine by once its loop has ended; a call or an orphan that reaches it
    anyway gets an answer, never silence."""
    engine, _, hub = _engine(tokenizer)
    engine.stop()
    await engine.run()
    assert not engine.serving
    (uid,) = submit(engine, "late", [5, 6, 7], _params(3))
    verdict, message = hub.verdicts[uid]
    assert verdict is Verdict.UNAVAILABLE and "w-test is gone" in message
    assert not engine.knows("late") and uid not in hub.streams
    orphan = Orphan(LiveSample("moved", 1 << 40, "moved", "owner", 0.0), [5, 6, 7], _params(3))
    engine.adopt([orphan])
    (stream,) = await finished(hub, [1 << 40], timeout=1)
    assert stream.finished is not None and stream.finished.kind.value == "abort"
    assert "is gone too" in stream.finished.message and not engine.knows("moved")


async def test_an_engine_abandoned_before_its_loop_ran_ends_its_calls(tokenizer: Tokenizer) -> None:
    """The welcome failed with a call already routed here and no other worker: it ends with why."""
    engine, _, hub = _engine(tokenizer)
    (uid,) = submit(engine, "early", [5, 6, 7], _params(3))
    engine.abandon("the welcome could not be sent")
    assert hub.verdicts[uid][0] is Verdict.ACCEPTED
    (stream,) = await finished(hub, [uid], timeout=1)
    assert stream.finished is not None and stream.finished.kind.value == "abort"
    assert "the welcome could not be sent" in stream.finished.message
    assert not engine.serving and not engine.knows("early")


class EndingChannel(FakeChannel):
    """A FakeChannel that can fail on cue and lingers in its session's end: `close` and `move` wait
    for `gate`, with `ending` set, so a test can act while the loop is on its way out (as a real
    channel's last write takes a while). Once `failure` is set, the next result goes through it
    (which may raise, as a broken stream does), after `just_before` ran."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.ending = asyncio.Event()
        self.gate = asyncio.Event()
        self.failure: Callable[[StepResult], StepResult] | None = None
        self.just_before: Callable[[], None] | None = None

    async def receive(self) -> StepResult:
        result = await super().receive()
        if self.failure is None:
            return result
        if self.just_before is not None:
            self.just_before()
        return self.failure(result)

    async def close(self, reason: str) -> None:
        self.ending.set()
        await self.gate.wait()
        await super().close(reason)

    async def move(self, reason: str) -> None:
        self.ending.set()
        await self.gate.wait()
        await super().move(reason)

    async def drop(self, reason: str) -> None:
        self.ending.set()
        await self.gate.wait()
        await super().drop(reason)


def _one_token_too_many(result: StepResult) -> StepResult:
    return dataclasses.replace(result, token_ids=np.append(result.token_ids, 1).astype(np.int32))


def _stream_broke(result: StepResult) -> StepResult:
    raise WorkerGone("stream closed")


class Fleet:
    """Engines `a` (on an EndingChannel) and `b` behind one router, wired and served as the server
    does: each loop runs, and its engine is detached once the loop has returned."""

    def __init__(self) -> None:
        self.hub = FakeHub()
        self.router = Router[engine_module.Engine]("test")
        fleet = WorkerFleet(self.router)
        self.a, channel, _ = make_engine(
            1000,
            step_s=0.002,
            worker_id="a",
            hub=self.hub,
            fleet=fleet,
            channel_class=EndingChannel,
        )
        assert isinstance(channel, EndingChannel)
        self.channel = channel
        self.b, _, _ = make_engine(1000, step_s=0.002, worker_id="b", hub=self.hub, fleet=fleet)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        for engine in (self.a, self.b):
            self.router.attach(engine)
            self.tasks[engine.worker] = asyncio.create_task(self._serve(engine))

    async def _serve(self, engine: engine_module.Engine) -> None:
        try:
            await engine.run()
        finally:
            self.router.detach(engine)

    def route(self, rid: str, max_new: int) -> int:
        """A call as the hub places it: on the engine the router picks."""
        engine = self.router.pick()
        assert engine is not None
        return submit(engine, rid, [5, 6, 7, len(rid)], _params(max_new))[0]

    async def close(self) -> None:
        self.channel.gate.set()
        for engine in (self.a, self.b):
            engine.stop()
        for task in self.tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    made = Fleet()
    try:
        yield made
    finally:
        await made.close()


EXITS = ["bad result", "stream broke", "cancelled", "stopped", "drained"]


@pytest.mark.parametrize("exit", EXITS)
async def test_every_call_ends_whichever_way_the_loop_ends(fleet: Fleet, exit: str) -> None:
    """A call running on `a`, one still in its inbox as the loop ends, and calls routed while the
    loop is on its way out all end: with every token (continued on `b`) or an abort that says why.
    Only the calls a stopped engine held may end with an abort."""
    a, b = fleet.a, fleet.b
    busy = [submit(b, f"b{i}", [5, 6, 7, i], _params(400))[0] for i in range(4)]  # b is the busier
    calls = {"running": submit(a, "running", [5, 6, 7], _params(60))[0]}
    while not all(fleet.hub.stream(u).tokens for u in [calls["running"], *busy]):
        await asyncio.sleep(0.001)

    def arrive_in_the_inbox() -> None:
        calls["inbox"] = submit(a, "inbox", [5, 6, 8], _params(20))[0]

    if exit in ("bad result", "stream broke"):
        fleet.channel.just_before = arrive_in_the_inbox
        fleet.channel.failure = _one_token_too_many if exit == "bad result" else _stream_broke
    elif exit == "cancelled":  # gRPC cancels the Connect handler when the worker's connection drops
        arrive_in_the_inbox()
        fleet.tasks["a"].cancel()
    elif exit == "stopped":
        arrive_in_the_inbox()
        a.stop()
    else:
        arrive_in_the_inbox()
        a.leave(Departure.SHUTDOWN, "the worker is stopping")
    await asyncio.wait_for(fleet.channel.ending.wait(), 10)
    for i in range(3):
        calls[f"late{i}"] = fleet.route(f"late{i}", 20)
    fleet.channel.gate.set()
    with contextlib.suppress(TimeoutError):
        await finished(fleet.hub, list(calls.values()), timeout=5)
    assert [rid for rid, uid in calls.items() if fleet.hub.stream(uid).finished is None] == []
    for rid, uid in calls.items():
        reason = fleet.hub.stream(uid).finished
        assert (
            reason is not None and fleet.hub.verdicts.get(uid, (Verdict.ACCEPTED, ""))[0] is Verdict.ACCEPTED
        )
        if exit == "stopped" and rid in ("running", "inbox"):
            assert reason.kind.value == "abort" and reason.message, (rid, reason)
        else:
            assert reason.kind.value == "length", (rid, reason)
    assert not a.knows("late0") and not a.streams
    await finished(fleet.hub, busy, timeout=10)
    # The session's last word: a worker let go for a fault is told why (and searches again); only a
    # stop of the control plane is a Shutdown; a drain ends with its own Shutdown.
    channel = fleet.channel
    if exit == "bad result":
        assert channel.dropped.startswith("dropped by the control plane:") and not channel.closed
    elif exit == "stopped":
        assert channel.closed == engine_module.SHUTTING_DOWN and not channel.dropped
    elif exit == "drained":
        assert channel.closed == DRAINED and not channel.dropped
