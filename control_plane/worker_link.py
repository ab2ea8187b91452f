"""The control plane's end of one worker's Connect stream: plans down, results up, in order.

Plans are encoded by the link's PlanEncoder, so the decode set travels as a delta against the
previous decode plan (the worker's PlanDecoder keeps the same state). Any number of plans may be
in flight: `send` writes one, `receive` reads the result of the oldest one still unanswered, and
checks that it carries one token per sequence that plan sampled. A stream that broke is WorkerGone;
a message that breaks the protocol is WorkerFault (the worker is dropped either way).
"""

from __future__ import annotations

import asyncio
from collections import deque

import grpc

from control_plane import codec
from control_plane.failover import WorkerGone
from control_plane.scheduler.plan import StepPlan, StepResult
from control_plane.worker_checks import WorkerFault


class StreamChannel:
    """A WorkerChannel over one worker's Connect stream."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context
        self.encoder = codec.PlanEncoder()
        # Tokens each sent plan's result must carry, oldest plan first.
        self._awaiting: deque[int] = deque()

    @property
    def in_flight(self) -> int:
        """Plans sent whose results have not been received yet."""
        return len(self._awaiting)

    async def send(self, plan: StepPlan) -> None:
        message = self.encoder.encode(plan)  # a failure here is ours, not the worker's
        self._awaiting.append(codec.sampled_count(plan))
        try:
            await self.context.write(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _gone(exc) from exc

    async def receive(self) -> StepResult:
        """The result of the oldest plan in flight (RuntimeError when none is)."""
        if not self._awaiting:
            raise RuntimeError("receive() with no plan in flight")
        sampled = self._awaiting.popleft()
        try:
            msg = await self.context.read()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _gone(exc) from exc
        if msg is grpc.aio.EOF or msg is None:  # type: ignore[attr-defined]
            raise WorkerGone("stream closed")
        if msg.WhichOneof("msg") != "result":
            raise WorkerFault(f"expected a step result, got {msg.WhichOneof('msg') or 'an empty message'}")
        try:
            return codec.result_from_proto(msg.result, sampled)
        except codec.ProtocolError as exc:
            raise WorkerFault(str(exc)) from None

    async def close(self, reason: str) -> None:
        await self.context.write(codec.shutdown(reason))


def _gone(exc: Exception) -> WorkerGone:
    # grpc raises several types (AioRpcError, InvalidStateError, cygrpc's ExecuteBatchError) for a
    # stream that broke under us: all mean the worker is gone.
    return WorkerGone(f"{type(exc).__name__}: {exc}")
