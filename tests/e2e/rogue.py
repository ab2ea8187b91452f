"""A hand-driven worker over real gRPC: says whatever hello and results a test wants.

It speaks the WorkerLink protocol (version 2) from the test process, so a test can play a buggy,
hostile or hung worker against a real control plane process and check what the control plane does
about it. Plans are read with the data plane's PlanDecoder (their decode sets are deltas), and
`honest_result` builds the result a well-behaved worker would send, for a test to corrupt.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import grpc
import numpy as np

from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.stepwise.v1 import worker_pb2_grpc as wk_grpc
from protos.worker import StepPlan, sampled_handles
from protos.worker_codec import PlanDecoder

EMBEDDED_VOCAB = 1024


def hello(worker_id: str = "rogue", **fields: object) -> wk_pb.Hello:
    """A plausible hello for the embedded model; `fields` override any field."""
    values: dict[str, object] = {
        "worker_id": worker_id,
        "model_fingerprint": "",
        "kv_capacity_tokens": 4096,
        "page_size": 1,
        "max_context": 2048,
        "vocab_size": EMBEDDED_VOCAB,
        "dtype": "sim",
        "device": "sim",
        "protocol_version": 2,
        "eos_token_ids": [2],
    }
    values.update(fields)
    return wk_pb.Hello(**values)  # type: ignore[arg-type]


@dataclass
class RogueWorker:
    """`async with RogueWorker(address, hello(...)) as rogue: plan = await rogue.plan()`."""

    address: str
    hello: wk_pb.Hello
    credentials: grpc.ChannelCredentials | None = None
    welcome: wk_pb.Welcome | None = None
    decoder: PlanDecoder = field(default_factory=PlanDecoder, repr=False)
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)
    _call: grpc.aio.StreamStreamCall | None = field(default=None, repr=False)

    async def __aenter__(self) -> RogueWorker:
        if self.credentials is not None:
            self._channel = grpc.aio.secure_channel(self.address, self.credentials)
        else:
            self._channel = grpc.aio.insecure_channel(self.address)
        self._call = wk_grpc.WorkerLinkStub(self._channel).Connect()
        await self._call.write(wk_pb.WorkerMessage(hello=self.hello))
        msg = await self.read()
        self.welcome = msg.welcome if msg is not None and msg.HasField("welcome") else None
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._channel is not None
        await self._channel.close(grace=None)

    async def read(self, timeout: float = 30.0) -> wk_pb.ControlMessage | None:
        """The next control message, or None when the control plane ended the stream."""
        assert self._call is not None
        msg = await asyncio.wait_for(self._call.read(), timeout)
        return None if msg is grpc.aio.EOF else msg  # type: ignore[attr-defined, return-value]

    async def plan(self, timeout: float = 30.0) -> StepPlan:
        """The next plan, decoded against the plans before it."""
        msg = await self.read(timeout)
        assert msg is not None and msg.HasField("plan"), f"expected a plan, got {msg}"
        return self.decoder.plan(msg.plan)

    async def send(self, result: wk_pb.StepResult) -> None:
        assert self._call is not None
        await self._call.write(wk_pb.WorkerMessage(result=result))

    async def send_raw(self, message: wk_pb.WorkerMessage) -> None:
        assert self._call is not None
        await self._call.write(message)

    async def ended(self, timeout: float = 30.0) -> grpc.StatusCode | None:
        """Wait for the control plane to end the stream; its status code (None: it never did)."""
        assert self._call is not None
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            while await asyncio.wait_for(self._call.read(), timeout) is not grpc.aio.EOF:  # type: ignore[attr-defined]
                pass
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self._call.code(), 1.0)  # type: ignore[no-any-return]
        return None


def honest_result(plan: StepPlan, live: set[int], token: int = 7) -> wk_pb.StepResult:
    """The result a well-behaved worker would send (every sampled sequence gets `token`).

    `live` is the caller's set of live handles, updated by the plan; KV books are not modelled, so
    the control plane may log a book mismatch, which these tests do not look at.
    """
    live.difference_update(plan.releases.tolist())
    live.update(s.handle for s in plan.new_seqs)
    return wk_pb.StepResult(
        step_id=plan.step_id,
        token_ids=tokens_bytes([token] * len(sampled_handles(plan))),
        kv=wk_pb.KvReport(live_seqs=len(live), capacity_tokens=0),
    )


def tokens_bytes(tokens: list[int]) -> bytes:
    """Token ids as a result carries them: int32 little-endian (any int32, to send bad ones too)."""
    return np.asarray(tokens, dtype="<i4").tobytes()


def tokens_of(result: wk_pb.StepResult) -> list[int]:
    return np.frombuffer(result.token_ids, dtype="<i4").tolist()
