"""A sim worker in the test process, over real gRPC: it runs its plans on the sim backend (no model),
answers each, can send Drain, and records how its session ended (Shutdown, Move, or a broken stream).

The control plane's side of drains and moves is tested with it: a test decides when the worker
drains and what it does after a Move, while the plans run as a real sim worker runs them (the same
SimExecutor, so every token depends on the request id and position alone, on whichever worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

import grpc

from data_plane.sim import CostModel, SimExecutor
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.stepwise.v1 import worker_pb2_grpc as wk_grpc
from protos.worker_codec import PlanDecoder, result_to_proto
from stepwise.models import resolve_model

KV_TOKENS = 65536


def sim_hello(worker_id: str) -> wk_pb.Hello:
    """The hello of a sim worker for the embedded model (as `stepwise worker --backend sim` says)."""
    config = json.loads((resolve_model("embedded") / "config.json").read_text())
    eos = config.get("eos_token_id", 0)
    return wk_pb.Hello(
        worker_id=worker_id,
        kv_capacity_tokens=KV_TOKENS,
        page_size=1,
        max_context=int(config.get("max_position_embeddings", 4096)),
        vocab_size=int(config["vocab_size"]),
        dtype="sim",
        device="sim",
        protocol_version=2,
        eos_token_ids=eos if isinstance(eos, list) else [int(eos)],
    )


@dataclass
class LinkWorker:
    """`worker = await LinkWorker(address, "w0").attach()`; `await worker.close()` in a finally."""

    address: str
    worker_id: str
    # Seconds each step takes (besides the sim's own, negligible, work).
    step_s: float = 0.005
    welcome: wk_pb.Welcome | None = None
    # The message that ended the session (its Shutdown or Move); None while it runs, or if it broke.
    ending: wk_pb.ControlMessage | None = None
    error: str = ""
    steps: int = 0
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)
    _call: grpc.aio.StreamStreamCall | None = field(default=None, repr=False)
    _task: asyncio.Task[None] | None = field(default=None, repr=False)
    _writing: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    async def attach(self, timeout: float = 30.0) -> LinkWorker:
        """Dial, say hello, read the welcome; when accepted, run plans in a task of its own."""
        self._channel = grpc.aio.insecure_channel(self.address)
        self._call = wk_grpc.WorkerLinkStub(self._channel).Connect()
        await self._call.write(wk_pb.WorkerMessage(hello=sim_hello(self.worker_id)))
        msg = await asyncio.wait_for(self._call.read(), timeout)
        assert msg is not grpc.aio.EOF and msg.HasField("welcome"), f"expected a welcome, got {msg}"  # type: ignore[attr-defined, union-attr]
        self.welcome = msg.welcome  # type: ignore[union-attr]
        if self.welcome.accepted:
            self._task = asyncio.create_task(self._serve())
        else:
            self.ended.set()
        return self

    async def drain(self, reason: str = "SIGTERM") -> None:
        """What a worker sends when it is told to stop: it keeps running plans until Shutdown."""
        await self._write(wk_pb.WorkerMessage(drain=wk_pb.Drain(reason=reason)))

    @property
    def ended_with(self) -> str:
        """ "shutdown", "move", or "" (still running, or the stream broke: see `error`)."""
        if self.ending is None:
            return ""
        return self.ending.WhichOneof("msg") or ""

    async def wait_ended(self, timeout: float = 30.0) -> str:
        await asyncio.wait_for(self.ended.wait(), timeout)
        return self.ended_with

    async def _serve(self) -> None:
        assert self._call is not None
        decoder = PlanDecoder()
        hello = sim_hello(self.worker_id)
        executor = SimExecutor(KV_TOKENS, hello.vocab_size, hello.eos_token_ids[0], CostModel(0, 0, 0))
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:  # type: ignore[attr-defined]
                    self.error = "the control plane closed the stream"
                    return
                if msg.WhichOneof("msg") != "plan":  # type: ignore[union-attr]
                    self.ending = msg  # type: ignore[assignment]
                    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        await self._call.done_writing()
                    return
                result = executor.execute(decoder.plan(msg.plan))  # type: ignore[union-attr]
                await asyncio.sleep(self.step_s)
                await self._write(result_to_proto(result))
                self.steps += 1
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended.set()

    async def _write(self, message: wk_pb.WorkerMessage) -> None:
        assert self._call is not None
        async with self._writing:  # one write at a time on a gRPC stream
            await self._call.write(message)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._channel is not None:
            await self._channel.close(grace=None)


async def census(address: str, timeout: float = 5.0) -> wk_pb.CensusReply:
    """Ask a control plane's worker port for its census."""
    async with grpc.aio.insecure_channel(address) as channel:
        return await wk_grpc.WorkerLinkStub(channel).Census(wk_pb.CensusRequest(), timeout=timeout)  # type: ignore[no-any-return]
