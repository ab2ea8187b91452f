"""The census (census.py) and the control plane's drain (ControlPlane.drain), in process: engines over
fake workers attached to a ControlPlane that is built but not started (no ports, no frontends)."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from collections.abc import AsyncIterator

import pytest
from grpc_health.v1 import health_pb2

from control_plane.config import ControlConfig, SchedulerConfig
from control_plane.core.drain import Departure
from control_plane.core.engine import Engine
from control_plane.core.server import MOVE_ON_DRAIN, WORKER_SERVICE, ControlPlane, WorkerLinkService
from control_plane.request import RequestParams
from protos import worker_codec
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.worker import Census, SamplerParams, WorkerLimits
from stepwise.models import resolve_model
from tests.control_plane.fake_core import FakeChannel, FakeHub, finished, make_engine, submit
from tests.polling import until

pytestmark = pytest.mark.timeout(60)

VOCAB = 1000
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _params(max_new: int) -> RequestParams:
    return RequestParams(max_new_tokens=max_new, sampler=SamplerParams(temperature=0.0), ignore_eos=True)


class Plane:
    """A ControlPlane with engines attached as its worker service attaches them; each engine's loop
    runs, and the engine is detached when its session ends (as the Connect handler does)."""

    def __init__(self, drain_timeout_s: float) -> None:
        config = ControlConfig(resolve_model("embedded"), drain_timeout_s=drain_timeout_s)
        self.plane = ControlPlane(config)
        self.hub = FakeHub()
        self.channels: dict[str, FakeChannel] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def attach(self, worker: str, step_s: float = 0.002) -> Engine:
        engine, channel, _ = make_engine(
            VOCAB,
            step_s=step_s,
            control={"drain_timeout_s": self.plane.config.drain_timeout_s},
            worker_id=worker,
            hub=self.hub,
            fleet=self.plane.fleet,
        )
        self.plane.router.attach(engine)
        self.channels[worker] = channel
        self.tasks.append(asyncio.create_task(self._serve(engine)))
        return engine

    async def _serve(self, engine: Engine) -> None:
        try:
            await engine.run()
        finally:
            self.plane.router.detach(engine)

    async def health(self, service: str) -> int:
        request = health_pb2.HealthCheckRequest(service=service)
        reply = await self.plane.health.Check(request, None)
        return int(reply.status)

    async def close(self) -> None:
        self.plane.router.stop_all()
        await asyncio.gather(*self.tasks)
        shutil.rmtree(self.plane._dir, ignore_errors=True)


@pytest.fixture
async def plane_factory() -> AsyncIterator[object]:
    planes: list[Plane] = []

    def make(drain_timeout_s: float = 30.0) -> Plane:
        plane = Plane(drain_timeout_s)
        planes.append(plane)
        return plane

    try:
        yield make
    finally:
        for plane in planes:
            await plane.close()


async def test_census_counts_workers_and_load_and_leaves_out_a_leaving_worker(plane_factory) -> None:
    p: Plane = plane_factory()
    assert p.plane.census() == Census(p.plane.id, 0, 0, 0, accepting=True)
    a, b = p.attach("a"), p.attach("b", step_s=0.01)
    uids = [submit(b, f"r{i}", [5, 6, 7], _params(400))[0] for i in range(3)]
    await until(lambda: all(p.hub.stream(u).tokens for u in uids), 10.0, every_s=0.001)
    now = p.plane.census()
    assert (now.workers, now.running, now.queued, now.accepting) == (2, 3, 0, True)
    assert len(now.control_plane_id) == 32
    b.leave(Departure.MOVE, "rebalancing")  # b and its load no longer count
    now = p.plane.census()
    assert (now.workers, now.running) == (1, 0)
    # The wire form carries every field.
    assert worker_codec.census_from_proto(worker_codec.census_to_proto(now)) == now
    assert isinstance(worker_codec.census_to_proto(now), wk_pb.CensusReply)
    assert a.leaving is None


async def test_drain_refuses_new_work_lets_streams_finish_aborts_the_rest_and_moves_workers(
    plane_factory,
) -> None:
    p: Plane = plane_factory(drain_timeout_s=0.5)
    a, b = p.attach("a"), p.attach("b", step_s=0.005)
    await until(lambda: p.plane._serving(), 10.0, every_s=0.001)
    (short,) = submit(a, "short", [5, 6, 7], _params(30))
    (long,) = submit(b, "long", [5, 6, 7], _params(5000))
    await until(lambda: p.hub.stream(short).tokens and p.hub.stream(long).tokens, 10.0, every_s=0.001)
    drain = asyncio.create_task(p.plane.drain())
    await until(lambda: p.plane.draining, 10.0, every_s=0.001)
    assert not p.plane.census().accepting and p.plane.hub.draining
    assert await p.health("") == NOT_SERVING and await p.health(WORKER_SERVICE) == NOT_SERVING
    await asyncio.wait_for(drain, 10)
    short_stream, long_stream = await finished(p.hub, [short, long], timeout=1)
    assert (len(short_stream.tokens), short_stream.finished.kind.value) == (30, "length")  # type: ignore[union-attr]
    assert long_stream.finished is not None and long_stream.finished.kind.value == "abort"
    assert long_stream.finished.message.startswith("control plane drained")
    assert "retry on another control plane" in long_stream.finished.message
    assert {w: c.moved for w, c in p.channels.items()} == {"a": MOVE_ON_DRAIN, "b": MOVE_ON_DRAIN}
    assert not p.plane.router.engines


async def test_a_second_drain_is_a_no_op_and_workers_without_requests_move_at_once(plane_factory) -> None:
    p: Plane = plane_factory(drain_timeout_s=30)
    p.attach("a")
    await asyncio.wait_for(p.plane.drain(), 5)  # nothing live: no wait for the timeout
    await asyncio.wait_for(p.plane.drain(), 1)
    assert p.channels["a"].moved == MOVE_ON_DRAIN


async def test_census_asked_about_a_hello_says_whether_connect_would_refuse_it_for_good() -> None:
    """A control plane with --page-size 16 has no workers, so it looks emptiest: its census must
    say that it refuses a page-size-1 worker, with the reason Connect would give."""
    config = ControlConfig(resolve_model("embedded"), scheduler=SchedulerConfig(page_size=16))
    plane = ControlPlane(config)
    try:
        service = WorkerLinkService(plane)
        vocab = plane.tokenizer.vocab_size
        hello = WorkerLimits("w-1", kv_capacity_tokens=1024, page_size=1, max_context=2048, vocab_size=vocab)

        async def census(asked: WorkerLimits | None) -> Census:
            reply = await service.Census(worker_codec.census_request(asked), None)  # type: ignore[arg-type]
            return worker_codec.census_from_proto(reply)

        refused = await census(hello)
        assert refused.refuses() and refused.workers == 0 and refused.accepting
        assert refused.refusal == "page_size 1 differs from the control plane's --page-size 16"
        taken = await census(dataclasses.replace(hello, page_size=16))
        assert taken.hello_judged and not taken.refuses()
        implausible = await census(dataclasses.replace(hello, page_size=16, vocab_size=1))
        assert implausible.refuses() and implausible.refusal.startswith("vocab_size 1 is not plausible")
        counts_only = await census(None)
        assert not counts_only.hello_judged and not counts_only.refuses()
    finally:
        shutil.rmtree(plane._dir, ignore_errors=True)
