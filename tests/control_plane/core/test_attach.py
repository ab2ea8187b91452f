"""A worker's Connect handler (server.py) in process: a fake gRPC context plays the worker, against a
ControlPlane that is built but not started (no ports, no frontends)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator

import pytest

from control_plane.config import ControlConfig
from control_plane.core.server import ControlPlane, WorkerLinkService
from control_plane.request import RequestParams
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.worker import SamplerParams
from stepwise.models import resolve_model
from tests.control_plane.fake_core import FakeHub, finished, make_engine, submit

pytestmark = pytest.mark.timeout(60)


class BrokenWelcome:
    """A worker whose stream breaks while the welcome is on its way: `write` waits for `gate` (with
    `welcoming` set), then fails as a broken stream's write does."""

    def __init__(self, hello: wk_pb.Hello) -> None:
        self.hello = hello
        self.welcoming = asyncio.Event()
        self.gate = asyncio.Event()

    async def read(self) -> wk_pb.WorkerMessage:
        return wk_pb.WorkerMessage(hello=self.hello)

    async def write(self, message: wk_pb.ControlMessage) -> None:
        self.welcoming.set()
        await self.gate.wait()
        raise RuntimeError("the stream broke")


@pytest.fixture
async def plane() -> AsyncIterator[ControlPlane]:
    made = ControlPlane(ControlConfig(resolve_model("embedded")))
    try:
        yield made
    finally:
        made.router.stop_all()
        shutil.rmtree(made._dir, ignore_errors=True)


async def test_a_call_routed_to_a_worker_whose_welcome_fails_continues_elsewhere(plane: ControlPlane) -> None:
    """The worker is attached before its welcome goes out (so a call right after the welcome finds
    it): a call the router gives it meanwhile must not vanish when the welcome fails."""
    hub = FakeHub()
    heir, _, _ = make_engine(1000, worker_id="b", hub=hub, fleet=plane.fleet)
    plane.router.attach(heir)
    heir_task = asyncio.create_task(heir.run())
    service = WorkerLinkService(plane)
    service.hub = hub  # what the engines publish is recorded here
    tokenizer = plane.tokenizer
    # Sorts before "b": a tie in load sends the call to it.
    context = BrokenWelcome(
        wk_pb.Hello(
            worker_id="a",
            kv_capacity_tokens=4096,
            page_size=1,
            max_context=2048,
            vocab_size=tokenizer.vocab_size,
            dtype="sim",
            device="sim",
            protocol_version=2,
            eos_token_ids=sorted(tokenizer.eos_token_ids),
        )
    )
    connect = asyncio.create_task(service.Connect(None, context))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(context.welcoming.wait(), 10)
        engine = plane.router.pick()
        assert engine is not None and engine.worker == "a"
        params = RequestParams(max_new_tokens=5, sampler=SamplerParams(temperature=0.0), ignore_eos=True)
        (uid,) = submit(engine, "early", [5, 6, 7], params)
        context.gate.set()
        with pytest.raises(RuntimeError, match="the stream broke"):
            await asyncio.wait_for(connect, 10)
        assert not plane.router.has("a")
        (stream,) = await finished(hub, [uid], timeout=5)
        assert (
            stream.finished is not None and stream.finished.kind.value == "length" and len(stream.tokens) == 5
        )
    finally:
        context.gate.set()
        with contextlib.suppress(BaseException):
            await connect
        heir.stop()
        await heir_task
