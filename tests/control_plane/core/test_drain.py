"""A worker leaving (drain.py): two engines behind one router, fake workers behind them.

What a drain must keep: requests running on the leaving worker finish there (never introduced on
the other worker, never retracted), its queued requests and every new one run on the other worker,
and the session ends with Shutdown (a drain) or Move (a move) only once nothing is live. Past the
drain timeout, what still runs continues on the other worker with exactly the tokens a clean run
gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import structlog

from control_plane.core.drain import DRAINED, Departure
from control_plane.core.engine import Engine
from control_plane.core.fleet import Fleet, Router
from control_plane.request import RequestParams
from protos.worker import SamplerParams, StepPlan, StepResult
from tests.control_plane.fake_core import FakeChannel, FakeHub, Stream, finished, make_engine, submit
from tests.polling import until

pytestmark = pytest.mark.timeout(60)

VOCAB = 1000
PROMPT = [5, 6, 7, 8]


def _params(max_new: int) -> RequestParams:
    return RequestParams(max_new_tokens=max_new, sampler=SamplerParams(temperature=0.0), ignore_eos=True)


class Pair:
    """Engines `a` and `b` attached to one router (successors wired as the server wires them), each
    loop running; `introduced[w]` lists the request ids each worker was given a sequence for."""

    def __init__(self, drain_timeout_s: float, step_s: float, **scheduler: object) -> None:
        self.hub = FakeHub()
        self.router = Router[Engine]("test")
        fleet = Fleet(self.router)
        self.channels: dict[str, FakeChannel] = {}
        self.introduced: dict[str, list[str]] = {}
        self.engines: dict[str, Engine] = {}
        for worker in ("a", "b"):
            engine, channel, _ = make_engine(
                VOCAB,
                step_s=step_s,
                control={"drain_timeout_s": drain_timeout_s},
                worker_id=worker,
                hub=self.hub,
                fleet=fleet,
                **scheduler,
            )
            self.router.attach(engine)
            self.engines[worker], self.channels[worker] = engine, channel
            self.introduced[worker] = _record_new_sequences(channel)
        self.tasks = {w: asyncio.create_task(e.run()) for w, e in self.engines.items()}

    @property
    def a(self) -> Engine:
        return self.engines["a"]

    @property
    def b(self) -> Engine:
        return self.engines["b"]

    async def stop(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        await asyncio.gather(*self.tasks.values())


def _record_new_sequences(channel: FakeChannel) -> list[str]:
    seen: list[str] = []
    run = channel.worker.run

    def run_and_note(plan: StepPlan) -> StepResult:
        seen.extend(seq.request_id for seq in plan.new_seqs)
        return run(plan)

    channel.worker.run = run_and_note  # type: ignore[method-assign]
    return seen


@pytest.fixture
async def pair_factory() -> AsyncIterator[object]:
    pairs: list[Pair] = []

    def make(drain_timeout_s: float = 30.0, step_s: float = 0.002, **scheduler: object) -> Pair:
        pair = Pair(drain_timeout_s, step_s, **scheduler)
        pairs.append(pair)
        return pair

    try:
        yield make
    finally:
        for pair in pairs:
            await pair.stop()


def _lengths(streams: list[Stream]) -> list[int]:
    return [len(s.tokens) for s in streams]


async def _clean_tokens(rids: list[str], max_new: int) -> list[list[int]]:
    """What each request streams on one engine that never leaves."""
    engine, _, hub = make_engine(VOCAB)
    task = asyncio.create_task(engine.run())
    uids = [submit(engine, rid, PROMPT, _params(max_new))[0] for rid in rids]
    streams = await finished(hub, uids)
    engine.stop()
    await task
    return [s.tokens for s in streams]


async def test_a_draining_worker_finishes_its_running_requests_and_hands_on_the_queued(
    pair_factory,
) -> None:
    pair: Pair = pair_factory(max_running_requests=2)
    running = [submit(pair.a, f"run{i}", PROMPT, _params(60))[0] for i in range(2)]
    queued = [submit(pair.a, f"queued{i}", PROMPT, _params(20))[0] for i in range(3)]
    await until(lambda: all(pair.hub.stream(u).tokens for u in running), 10.0, every_s=0.001)
    assert len(pair.a.scheduler.waiting) == 3  # max_running_requests=2 holds them back
    with structlog.testing.capture_logs() as logs:
        pair.a.worker_draining("SIGTERM")
        assert pair.router.pick() is pair.b  # at once, before the loop's next turn
        late = submit(pair.router.pick(), "late", PROMPT, _params(20))  # type: ignore[arg-type]
        streams = await finished(pair.hub, [*running, *queued, *late])
        await asyncio.wait_for(pair.tasks["a"], 10)  # the session ended by itself
    assert _lengths(streams) == [60, 60, 20, 20, 20, 20]
    assert all(s.finished is not None and s.finished.kind.value == "length" for s in streams)
    # The running ones stayed where they were, once each and never retracted; the rest went to b.
    assert pair.introduced["a"] == ["run0", "run1"]
    assert sorted(pair.introduced["b"]) == ["late", "queued0", "queued1", "queued2"]
    assert pair.a.scheduler.num_retracted_total == 0
    assert pair.channels["a"].closed == DRAINED and not pair.channels["a"].moved
    assert pair.a.fault is None and not pair.b.leaving
    assert await _clean_tokens(["run0", "run1"], 60) == [s.tokens for s in streams[:2]]
    start = next(e for e in logs if e["event"] == "worker draining")
    assert (start["running"], start["queued"], start["moved"], start["log_level"]) == (2, 3, 3, "info")
    end = next(e for e in logs if e["event"] == "worker drained")
    assert (end["finished"], end["handed_over"]) == (2, 0) and end["seconds"] >= 0
    assert not [e for e in logs if e["log_level"] == "error"]


async def test_past_the_drain_timeout_running_requests_continue_on_the_other_worker(pair_factory) -> None:
    pair: Pair = pair_factory(drain_timeout_s=0.05, step_s=0.005)
    uids = [submit(pair.a, f"long{i}", PROMPT, _params(150))[0] for i in range(2)]
    await until(lambda: all(len(pair.hub.stream(u).tokens) >= 3 for u in uids), 10.0, every_s=0.001)
    with structlog.testing.capture_logs() as logs:
        pair.a.worker_draining("SIGTERM")
        await asyncio.wait_for(pair.tasks["a"], 10)
        assert all(len(pair.hub.stream(u).tokens) < 150 for u in uids)  # cut short: handed over
        streams = await finished(pair.hub, uids)
    # Every token exactly once, in order: the clean run's.
    assert [s.tokens for s in streams] == await _clean_tokens(["long0", "long1"], 150)
    assert all(s.finished is not None and s.finished.kind.value == "length" for s in streams)
    assert sorted(pair.introduced["b"]) == ["long0", "long1"]
    assert pair.channels["a"].closed == DRAINED
    end = next(e for e in logs if e["event"] == "worker drained")
    assert (end["finished"], end["handed_over"]) == (0, 2)


async def test_past_the_drain_timeout_with_no_other_worker_the_requests_end_with_a_reason() -> None:
    engine, channel, hub = make_engine(VOCAB, step_s=0.005, control={"drain_timeout_s": 0.05})
    task = asyncio.create_task(engine.run())
    (uid,) = submit(engine, "long", PROMPT, _params(500))
    await until(lambda: hub.stream(uid).tokens, 10.0, every_s=0.001)
    engine.worker_draining("")
    (stream,) = await finished(hub, [uid])
    await asyncio.wait_for(task, 10)
    assert stream.finished is not None and stream.finished.kind.value == "abort"
    assert "drained" in stream.finished.message and "no other worker" in stream.finished.message
    assert channel.closed == DRAINED


async def test_a_moved_worker_gets_move_only_after_its_live_requests_are_done(pair_factory) -> None:
    pair: Pair = pair_factory(step_s=0.002)
    (uid,) = submit(pair.a, "r", PROMPT, _params(40))
    await until(lambda: pair.hub.stream(uid).tokens, 10.0, every_s=0.001)
    channel = pair.channels["a"]
    move = channel.move
    done_at_move: list[bool] = []

    async def noted_move(reason: str) -> None:
        done_at_move.append(pair.hub.stream(uid).finished is not None)
        await move(reason)

    channel.move = noted_move  # type: ignore[method-assign]
    pair.a.leave(Departure.MOVE, "rebalancing")
    assert pair.router.available() == [pair.b]
    (stream,) = await finished(pair.hub, [uid])
    await asyncio.wait_for(pair.tasks["a"], 10)
    assert len(stream.tokens) == 40
    assert done_at_move == [True]
    assert channel.moved == "rebalancing" and not channel.closed  # Move ends it, not Shutdown


async def test_an_idle_worker_leaves_at_once_and_a_drain_wins_over_a_move(pair_factory) -> None:
    pair: Pair = pair_factory()
    pair.a.leave(Departure.MOVE, "rebalancing")
    pair.a.worker_draining("SIGTERM")  # the worker stops anyway: it is told Shutdown
    await asyncio.wait_for(pair.tasks["a"], 5)
    assert pair.channels["a"].closed == DRAINED and not pair.channels["a"].moved
    assert pair.a.departed and pair.router.available() == [pair.b]
