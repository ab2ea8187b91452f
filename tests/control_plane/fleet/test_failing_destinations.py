"""A destination that hangs, goes away or fails its copies, over engines and FakeWorkers wired as the
server wires them (issue 37, items 1 and 2, the control plane's side): copies on their way to a
worker that leaves or is lost fail at once and their calls go on; calls in transit count in a
destination's load; a destination that failed a move sits out a growing back-off."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from control_plane.config import Limits
from control_plane.core.drain import Departure
from control_plane.core.engine import Engine
from control_plane.core.fleet import Fleet, Router
from control_plane.request import FinishKind, RequestParams
from protos.worker import SamplerParams, StepResult, TransferOutcome
from tests.control_plane.core.test_migration_engine import _alone
from tests.control_plane.fake_core import FakeChannel, FakeHub, make_engine, submit
from tests.polling import until

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def _params(max_new: int) -> RequestParams:
    return RequestParams(max_new_tokens=max_new, ignore_eos=True, sampler=SamplerParams(temperature=0.0))


class TroubledChannel(FakeChannel):
    """A source's channel: its copies to a `hung` address never have an outcome (a SIGSTOPped
    destination), those to a `failing` one fail; `sent_to` counts its KvSends by address."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.hung: set[str] = set()
        self.failing: set[str] = set()
        self.sent_to: Counter[str] = Counter()

    async def receive(self) -> StepResult:
        plan = self.sent[0]
        result = await super().receive()
        address = {send.transfer_id: send.address for send in plan.sends}
        self.sent_to.update(address.values())
        outcomes = []
        for outcome in result.transfers:
            to = address[outcome.transfer_id]
            if to in self.failing:
                outcome = TransferOutcome(outcome.transfer_id, "failed to connect to all addresses")
            if to not in self.hung:
                outcomes.append(outcome)
        return dataclasses.replace(result, transfers=tuple(outcomes))


class Plane:
    """Engines by worker id behind one router and one fleet, their workers on one network."""

    def __init__(self, roles: dict[str, str], **control: object) -> None:
        self.hub, self.router = FakeHub(), Router[Engine]("test")
        self.fleet = Fleet(self.router)
        network: dict[str, list[tuple[int, int]]] = {}
        self.engines: dict[str, Engine] = {}
        self.channels: dict[str, TroubledChannel] = {}
        for worker, role in roles.items():
            engine, channel, _ = make_engine(
                1000,
                capacity=4000,
                step_s=0.002,
                worker_id=worker,
                hub=self.hub,
                fleet=self.fleet,
                network=network,
                role=role,
                channel_class=TroubledChannel,
                control={"drain_timeout_s": 30.0, **control},
            )
            assert isinstance(channel, TroubledChannel)
            self.router.attach(engine)
            self.engines[worker], self.channels[worker] = engine, channel
        self.tasks = {w: asyncio.create_task(self._serve(e)) for w, e in self.engines.items()}

    async def _serve(self, engine: Engine) -> None:
        try:
            await engine.run()
        finally:
            self.router.detach(engine)

    def send(self, rid: str, max_new: int, prompt: list[int] = PROMPT) -> int:
        engine = self.router.pick(input_ids=None)
        assert engine is not None
        [uid] = submit(engine, rid, prompt, _params(max_new))
        return uid

    async def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        for task in self.tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task


@contextlib.asynccontextmanager
async def _plane(roles: dict[str, str], **control: object) -> AsyncIterator[Plane]:
    plane = Plane(roles, **control)
    try:
        yield plane
    finally:
        await plane.close()


def _exports_to(engine: Engine, worker: str) -> int:
    return sum(1 for e in engine.migration.exports.values() if e.destination.worker == worker)


PD = {"p": "prefill", "d0": "decode", "d1": "decode"}


@pytest.mark.parametrize("how", ["lost", "drained"])
async def test_a_destination_that_goes_away_releases_the_copies_on_their_way_to_it(how: str) -> None:
    """p hands a call to d0, whose copy hangs (d0 stopped while idle); when d0 is lost (its stream
    cancelled) or drains, the call goes on at once: back on p, then to d1, every token as on one
    worker. Before: the export waited for the copy's outcome, which never came."""
    async with _plane(PD) as plane:
        p, d0 = plane.engines["p"], plane.engines["d0"]
        plane.channels["p"].hung.add("d0:1")
        uid = plane.send("r", 60)
        stream = plane.hub.stream(uid)
        await until(lambda: _exports_to(p, "d0") == 1, 20.0, "the hand-off to d0", every_s=0.001)
        stuck = len(stream.tokens)
        await asyncio.sleep(0.1)
        assert len(stream.tokens) == stuck, "the call waits on the hung copy"
        if how == "lost":
            plane.tasks["d0"].cancel()
        else:
            d0.leave(Departure.SHUTDOWN, "the worker is stopping")
        await asyncio.wait_for(stream.done.wait(), 5)
        assert stream.finished is not None and stream.finished.kind is FinishKind.LENGTH
        assert stream.tokens == await _alone(60, PROMPT)
        assert plane.engines["d1"].migration.migrated_in == 1


async def test_a_copy_with_no_word_past_the_step_timeout_fails_and_its_call_goes_on() -> None:
    """d0 hangs while idle (never dropped: it has no step in flight) and p's copy to it never
    reports: past --worker-step-timeout (0.3 s here) the copy counts as failed, the call goes back
    onto p and on to d1. Before: it sat after its first tokens for as long as d0 hung."""
    async with _plane(PD, limits=Limits(worker_step_timeout_s=0.3)) as plane:
        p = plane.engines["p"]
        plane.channels["p"].hung.add("d0:1")
        uid = plane.send("r", 60)
        stream = plane.hub.stream(uid)
        await until(lambda: _exports_to(p, "d0") == 1, 20.0, "the hand-off to d0", every_s=0.001)
        await asyncio.wait_for(stream.done.wait(), 5)
        assert stream.finished is not None and stream.finished.kind is FinishKind.LENGTH
        assert stream.tokens == await _alone(60, PROMPT)
        assert plane.engines["d1"].migration.migrated_in == 1


async def test_calls_in_transit_count_in_a_destinations_load() -> None:
    """Ten new streams with d0 hung: each hand-off counts toward its destination at once, so d0,
    whose copies never land, does not stay the least loaded and take them all (before: all ten went
    to d0 and sat after their first token)."""
    async with _plane(PD) as plane:
        p, d1 = plane.engines["p"], plane.engines["d1"]
        plane.channels["p"].hung.add("d0:1")
        for i in range(10):
            plane.send(f"r{i}", 200, [30 + i, *PROMPT])
            await asyncio.sleep(0.004)
        await until(
            lambda: _exports_to(p, "d0") + d1.migration.migrated_in == 10,
            20.0,
            "ten hand-offs",
            every_s=0.001,
        )
        assert d1.migration.migrated_in >= 4, (_exports_to(p, "d0"), d1.migration.migrated_in)


async def test_a_drain_goes_on_to_the_healthy_peer_when_another_fails_its_copies() -> None:
    """a drains four calls with two idle peers, b first by its id; every copy to b fails. b sits
    out after its first failures and the calls move to c; the attempts toward b stay within one
    burst (before: a new pre-copy to b every turn, hundreds a second, and none went to c)."""
    async with _plane({"a": "mixed", "b": "mixed", "c": "mixed"}) as plane:
        a, c = plane.engines["a"], plane.engines["c"]
        plane.channels["a"].failing.add("b:1")
        prompts = [[40 + i, *PROMPT] for i in range(4)]
        uids = [submit(a, f"r{i}", prompt, _params(400))[0] for i, prompt in enumerate(prompts)]
        streams = [plane.hub.stream(uid) for uid in uids]
        await until(
            lambda: all(len(s.tokens) >= 2 for s in streams), 20.0, "two tokens each on a", every_s=0.001
        )
        a.leave(Departure.SHUTDOWN, "the worker is stopping")
        await until(lambda: a.departed, 20, "a drained", every_s=0.001)
        for stream, prompt in zip(streams, prompts, strict=True):
            await asyncio.wait_for(stream.done.wait(), 20)
            assert stream.finished is not None and stream.finished.kind is FinishKind.LENGTH
            assert stream.tokens == await _alone(400, prompt)
        assert c.migration.migrated_in == 4
        assert plane.channels["a"].sent_to["b:1"] <= 4, plane.channels["a"].sent_to
