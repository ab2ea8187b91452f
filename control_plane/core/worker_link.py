"""The control plane's end of one worker's Connect stream: plans down, results up, in order.

Plans are encoded by the link's PlanEncoder, so the decode set travels as a delta against the
previous decode plan (the worker's PlanDecoder keeps the same state). Any number of plans may be
in flight: `send` writes one, `receive` reads the result of the oldest one still unanswered, and
checks that it carries one token per sequence that plan sampled. A stream that broke is WorkerGone;
a message that breaks the protocol is WorkerFault (the worker is dropped either way).

A reader task reads the worker's messages as they come: results wait for `receive`; a Drain (the
worker got SIGTERM) goes to `on_drain`, and a transfer the worker received in full to
`on_received`, at once, between results or while no plan is in flight.
The session ends with one Shutdown (`close`) or one Move (`move`), never both.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import grpc
import structlog

from control_plane.core.handover import WorkerGone
from control_plane.core.worker_checks import WorkerFault
from protos import worker_codec
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.worker import (
    Dropped,
    Grammar,
    GrammarReady,
    Move,
    Shutdown,
    StepPlan,
    StepResult,
    TransferOutcome,
    sampled_count,
)

log = structlog.get_logger("stepwise.worker_link")

T = TypeVar("T")


class StreamChannel:
    """A WorkerChannel over one worker's Connect stream."""

    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        on_drain: Callable[[str], None] | None = None,
        on_received: Callable[[TransferOutcome], None] | None = None,
    ) -> None:
        self.context = context
        self.encoder = worker_codec.PlanEncoder()
        # Called with the worker's reason when it sends Drain (the engine starts leaving).
        self.on_drain = on_drain
        # Called with each transfer the worker reports it holds (a migration's copy arrived).
        self.on_received = on_received
        # Called with each grammar the worker reports compiled (the answer to `prepare`).
        self.on_grammar_ready: Callable[[GrammarReady], None] | None = None
        # Tokens each sent plan's result must carry, oldest plan first.
        self._awaiting: deque[int] = deque()
        # Plans sent whose results the reader has not read yet: a result beyond them is a fault (a
        # worker cannot fill our memory with results nobody asked for).
        self._unanswered = 0
        # What the reader read, in order: results, then the error that ended reading, if any.
        self._arrived: asyncio.Queue[wk_pb.StepResult | Exception] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self._writing = asyncio.Lock()
        self._ended = False

    @property
    def in_flight(self) -> int:
        """Plans sent whose results have not been received yet."""
        return len(self._awaiting)

    def start(self) -> None:
        """Read the worker's messages from now on (after the welcome went out)."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_all())

    async def send(self, plan: StepPlan) -> None:
        message = self.encoder.encode(plan)  # a failure here is ours, not the worker's
        self._awaiting.append(sampled_count(plan))
        self._unanswered += 1
        await self._write(message)

    async def receive(self) -> StepResult:
        """The result of the oldest plan in flight (RuntimeError when none is)."""
        if not self._awaiting:
            raise RuntimeError("receive() with no plan in flight")
        self.start()
        sampled = self._awaiting.popleft()
        arrived = await self._arrived.get()
        if isinstance(arrived, Exception):
            self._arrived.put_nowait(arrived)  # the stream stays ended for every later call
            raise arrived
        try:
            return worker_codec.result_from_proto(arrived, sampled)
        except worker_codec.ProtocolError as exc:
            raise WorkerFault(str(exc)) from None

    async def prepare(self, grammar: Grammar) -> None:
        """Ask the worker to compile `grammar` off its step (answered through on_grammar_ready)."""
        if not self._ended:
            await self._write(worker_codec.prepare_to_proto(grammar))

    async def close(self, reason: str) -> None:
        """End the session with Shutdown (once; later calls and a Move after it do nothing)."""
        await self._end(worker_codec.control_to_proto(Shutdown(reason)))

    async def move(self, reason: str) -> None:
        """End the session with Move: the worker attaches to another control plane."""
        await self._end(worker_codec.control_to_proto(Move(reason)))

    async def drop(self, reason: str) -> None:
        """End the session with Dropped: the worker is told why, and searches again."""
        await self._end(worker_codec.control_to_proto(Dropped(reason)))

    async def _end(self, message: wk_pb.ControlMessage) -> None:
        if self._ended:
            return
        self._ended = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._write(message)

    async def _write(self, message: wk_pb.ControlMessage) -> None:
        # One write at a time: a Prepare is written from a task of its own, beside the engine's
        # plans, and gRPC refuses a write while another is in progress.
        async with self._writing:
            await self._write_now(message)

    async def _write_now(self, message: wk_pb.ControlMessage) -> None:
        try:
            await self.context.write(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _gone(exc) from exc

    async def _read_all(self) -> None:
        try:
            while True:
                msg = await self.context.read()
                if msg is grpc.aio.EOF or msg is None:  # type: ignore[attr-defined]
                    raise WorkerGone("stream closed")
                kind = msg.WhichOneof("msg")
                if kind == "drain":
                    self._tell(self.on_drain, msg.drain.reason)
                elif kind == "received":
                    self._tell(self.on_received, _received(msg.received))
                elif kind == "grammar_ready":
                    self._tell(self.on_grammar_ready, _grammar_ready(msg.grammar_ready))
                elif kind == "result":
                    if not self._unanswered:
                        raise WorkerFault(f"a result for step {msg.result.step_id}, but no plan is in flight")
                    self._unanswered -= 1
                    self._arrived.put_nowait(msg.result)
                else:
                    raise WorkerFault(f"expected a step result, got {kind or 'an empty message'}")
        except asyncio.CancelledError:
            raise
        except (WorkerGone, WorkerFault) as exc:
            self._arrived.put_nowait(exc)
        except Exception as exc:
            self._arrived.put_nowait(_gone(exc))

    @staticmethod
    def _tell(listener: Callable[[T], None] | None, what: T) -> None:
        if listener is None:
            return
        try:
            listener(what)
        except Exception:  # ours: the session goes on, the word is lost (logged)
            log.exception("handling a worker's message failed", message=type(what).__name__)


def _received(msg: wk_pb.TransferOutcome) -> TransferOutcome:
    try:
        return worker_codec.received_from_proto(msg)
    except worker_codec.ProtocolError as exc:
        raise WorkerFault(str(exc)) from None


def _grammar_ready(msg: wk_pb.GrammarReady) -> GrammarReady:
    try:
        return worker_codec.grammar_ready_from_proto(msg)
    except worker_codec.ProtocolError as exc:
        raise WorkerFault(str(exc)) from None


def _gone(exc: Exception) -> WorkerGone:
    # grpc raises several types (AioRpcError, InvalidStateError, cygrpc's ExecuteBatchError) for a
    # stream that broke under us: all mean the worker is gone.
    return WorkerGone(f"{type(exc).__name__}: {exc}")
