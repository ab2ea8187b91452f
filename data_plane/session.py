"""One session with a control plane: Hello -> Welcome -> for each StepPlan: execute, answer with a
StepResult carrying the same step_id, until the control plane sends Shutdown or Move, or the stream
breaks.

The session is a pipeline: a reader task reads and decodes plans into a bounded queue as they
arrive, while the executor loop runs the plans in order (in a thread: the forward releases the
GIL) and a writer task writes their results in order. With two plans in flight the next one is
decoded and waiting when a step ends, so the worker starts it at once; each result says how long
the worker waited for its plan (`wait_s`).

What the executor holds (sequences, KV, host copies) and the decode set the plans diff against
belong to the session: a new session starts with both empty, as the control plane's first plan
to it assumes. So do the KV transfers the worker received for its control plane: those of an
earlier session are released when the next one starts (they land late when the worker was stopped
or cut off mid-copy; the control plane that would have claimed them forgot them with the session).

When the welcome asks for it (`transfer_reports`), the writer also reports each KV transfer the
worker's store completes, the moment it is complete (a `received` message between results): the
control plane then need not wait for the sender's next result to know the bytes are here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import time
from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog

from data_plane.kv_transfer import TransferStore
from data_plane.link import Link
from protos import worker_codec
from protos.stepwise.v1 import worker_pb2_grpc
from protos.worker import (
    Drain,
    Dropped,
    Grammar,
    GrammarReady,
    Move,
    Prepare,
    Shutdown,
    StepPlan,
    StepResult,
    TransferOutcome,
    Welcome,
    WorkerLimits,
)

# A control plane keeps a few plans in flight at most; past this many waiting, the reader stops
# reading (gRPC's flow control then holds the control plane back) rather than queue without bound.
MAX_QUEUED_PLANS = 8
# After a Move, how long the worker waits for the control plane to end the stream it half-closed.
CLOSE_GRACE_S = 1.0

log = structlog.get_logger("data_plane.session")


class StepExecutor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...

    def reset(self) -> None: ...

    def runs_inline(self, plan: StepPlan) -> bool:
        """Whether the plan is short enough to run on the event loop's own thread."""
        ...


class StreamBroken(Exception):
    """The control plane went away or broke the protocol."""


class Ending(enum.Enum):
    SHUTDOWN = "shutdown"  # the control plane told the worker to stop
    MOVED = "moved"  # ... to attach to another control plane
    DROPPED = "dropped"  # it let the worker go (a fault, a missed deadline): search again
    REFUSED = "refused"  # it refused the worker for good (model, protocol, page size)
    RETRY = "retry"  # it refused the worker for now (draining, or an old session not yet over)
    LOST = "lost"  # the stream broke, ended, or carried something the worker cannot read


@dataclass(frozen=True, slots=True)
class SessionEnd:
    ending: Ending
    # Whether the control plane welcomed the worker before the end.
    welcomed: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class _Arrived:
    """A decoded plan, and when it was ready (time.perf_counter())."""

    plan: StepPlan
    at: float


# What the reader hands the executor loop, in stream order: plans, then a Shutdown or Move, or the
# error that ended reading.
_Inbox = asyncio.Queue[_Arrived | Prepare | Shutdown | Move | Dropped | Exception]
# A hello unanswered this long ends the attempt as a lost control plane (the worker searches again).
WELCOME_TIMEOUT_S = 10.0

# What the writer writes, in order, until None: results, a drain, transfers received, grammars
# compiled.
_Outbox = asyncio.Queue[StepResult | Drain | TransferOutcome | GrammarReady | None]


async def run_session(
    executor: StepExecutor,
    hello: WorkerLimits,
    channel: grpc.aio.Channel,
    link: Link,
    received: TransferStore | None = None,
) -> SessionEnd:
    """Run one session on `channel`; every way the control plane can end it (a closed or broken
    stream, a refusal, no welcome, Shutdown, Move) is a SessionEnd. `received`: the store of the
    worker's KV transfer link, whose arrivals are reported when the welcome asks for them, and
    whose transfers of earlier sessions are released: no control plane will claim them."""
    executor.reset()
    if received is not None:
        received.new_session()
    call = worker_pb2_grpc.WorkerLinkStub(channel).Connect()
    welcomed = False
    try:
        await call.write(worker_codec.hello_to_proto(hello))
        decoder = worker_codec.PlanDecoder()
        # A control plane that answers the census but never the hello must not hold the worker.
        welcome = await asyncio.wait_for(_read(call, decoder), WELCOME_TIMEOUT_S)
        if not isinstance(welcome, Welcome):
            raise StreamBroken(f"expected Welcome, got {type(welcome).__name__}")
        if not welcome.accepted:
            return SessionEnd(Ending.RETRY if welcome.retryable else Ending.REFUSED, False, welcome.reason)
        welcomed = True
        log.info("welcomed", transfer_reports=welcome.transfer_reports)
        reports = received if welcome.transfer_reports else None
        async with link.attachment():
            return await _serve(executor, call, decoder, link, reports)
    except TimeoutError:
        return SessionEnd(Ending.LOST, False, f"no welcome within {WELCOME_TIMEOUT_S:g} s")
    except (grpc.aio.AioRpcError, StreamBroken, asyncio.InvalidStateError) as exc:
        # InvalidStateError: a write to a call that already ended
        return SessionEnd(Ending.LOST, welcomed, _describe(exc) or "control plane closed the stream")


async def _serve(
    executor: StepExecutor,
    call: grpc.aio.StreamStreamCall,
    decoder: worker_codec.PlanDecoder,
    link: Link,
    reports: TransferStore | None,
) -> SessionEnd:
    inbox: _Inbox = asyncio.Queue(maxsize=MAX_QUEUED_PLANS)
    reader = asyncio.create_task(_read_plans(call, decoder, inbox))
    try:
        return await _run_plans(executor, call, inbox, link, reports)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def _read(
    call: grpc.aio.StreamStreamCall, decoder: worker_codec.PlanDecoder
) -> Welcome | StepPlan | Shutdown | Move | Dropped | Prepare:
    msg = await call.read()
    if msg is grpc.aio.EOF:  # type: ignore[attr-defined]
        raise StreamBroken("control plane closed the stream")
    try:
        return decoder.control(msg)  # type: ignore[arg-type]
    except ValueError as exc:
        raise StreamBroken(f"control plane sent a message the worker cannot read: {exc}") from None


async def _read_plans(
    call: grpc.aio.StreamStreamCall, decoder: worker_codec.PlanDecoder, inbox: _Inbox
) -> None:
    """Read and decode every message as it arrives, while the executor loop runs earlier plans.
    Ends at a Shutdown or Move or at the first error, queued after the plans read before it."""
    try:
        while True:
            event = await _read(call, decoder)
            if isinstance(event, StepPlan):
                await inbox.put(_Arrived(event, time.perf_counter()))
            elif isinstance(event, Prepare):
                await inbox.put(event)
            elif isinstance(event, Shutdown | Move | Dropped):
                await inbox.put(event)
                return
            else:
                raise StreamBroken(f"control plane sent a {type(event).__name__} mid-session")
    except Exception as exc:
        await inbox.put(exc)


async def _run_plans(
    executor: StepExecutor,
    call: grpc.aio.StreamStreamCall,
    inbox: _Inbox,
    link: Link,
    reports: TransferStore | None,
) -> SessionEnd:
    """Execute the queued plans in order and answer each, until a Shutdown or Move comes.

    A result is written by a task of its own while the next plan already executes: the device never
    waits for the network (SGLang copies results back on a stream of their own for the same reason).
    A drain (the worker is stopping) goes out through the same writer, after the results before it,
    and so does the report of each transfer `reports` completes meanwhile.

    A step the executor calls short runs on the loop's thread: on CPU, a forward in a second thread
    and the loop reading plans and writing results pass the GIL back and forth all step long, which
    cost 15-20% of end-to-end throughput on the embedded model. Long steps (a big prefill, or any
    step on CUDA, which waits for the device) still run in a thread, so the loop keeps answering
    health checks and reading the stream while they run.
    """
    outbox: _Outbox = asyncio.Queue()
    writer = asyncio.create_task(_write_messages(call, outbox))
    drainer = asyncio.create_task(_send_drain(link, outbox))

    def report(transfer_id: str, nbytes: int) -> None:
        outbox.put_nowait(TransferOutcome(transfer_id, "", nbytes))

    listening = reports.listening(report) if reports is not None else contextlib.nullcontext()
    try:
        with listening:
            return await _execute(executor, call, inbox, outbox, writer)
    finally:
        for task in (drainer, writer):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, StreamBroken, grpc.aio.AioRpcError):
                await task


async def _execute(
    executor: StepExecutor,
    call: grpc.aio.StreamStreamCall,
    inbox: _Inbox,
    outbox: _Outbox,
    writer: asyncio.Task[None],
) -> SessionEnd:
    """The executor loop of `_run_plans`: each queued plan in turn, its result to the writer."""
    finished: float | None = None  # when the previous step ended
    while True:
        item = await _next(inbox, writer)
        if isinstance(item, Exception):
            raise item
        if isinstance(item, Dropped):
            # The control plane has forgotten this session: plans still queued are not run.
            return SessionEnd(Ending.DROPPED, True, item.reason)
        if isinstance(item, Shutdown | Move):
            return await _leave(call, outbox, writer, item)
        if isinstance(item, Prepare):
            _prepare(executor, item.grammar, outbox)
            continue
        wait_s = 0.0 if finished is None else max(0.0, item.at - finished)
        if executor.runs_inline(item.plan):
            result = executor.execute(item.plan)
        else:
            result = await asyncio.to_thread(executor.execute, item.plan)
        finished = time.perf_counter()
        if result.error:
            log.error("step_error", step_id=result.step_id, error=result.error)
        outbox.put_nowait(dataclasses.replace(result, wait_s=wait_s))


def _prepare(executor: StepExecutor, grammar: Grammar, outbox: _Outbox) -> None:
    """Start compiling `grammar` off the step; its GrammarReady goes out through the writer when it
    is done (between results). The step loop goes on meanwhile."""
    loop = asyncio.get_running_loop()

    def done(error: str) -> None:  # on a compile thread
        loop.call_soon_threadsafe(outbox.put_nowait, GrammarReady(grammar, error))

    prepare = getattr(executor, "prepare_grammar", None)
    if prepare is None:
        done("this worker compiles no grammars")
        return
    prepare(grammar, done)


async def _leave(
    call: grpc.aio.StreamStreamCall, outbox: _Outbox, writer: asyncio.Task[None], told: Shutdown | Move
) -> SessionEnd:
    """Write the results not yet written, half-close the stream, and for a Move give the control
    plane a moment to end it too (a clean end, not a cancelled call). The session ends as told even
    when the stream breaks meanwhile: nothing is live on the worker by then."""
    moved = isinstance(told, Move)
    log.info("moved" if moved else "shutdown", reason=told.reason)
    outbox.put_nowait(None)
    try:
        await writer
        await call.done_writing()
        if moved:
            await asyncio.wait_for(call.code(), CLOSE_GRACE_S)
    except (StreamBroken, grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError) as exc:
        log.info("stream_ended_while_leaving", error=_describe(exc) or type(exc).__name__)
    return SessionEnd(Ending.MOVED if moved else Ending.SHUTDOWN, True, told.reason)


async def _next(
    inbox: _Inbox, writer: asyncio.Task[None]
) -> _Arrived | Prepare | Shutdown | Move | Dropped | Exception:
    """The next queued item; a failed result writer ends the session as a broken stream would,
    unless the control plane's last word is on its way (see `_last_word`)."""
    if writer.done():
        return await _last_word(inbox, writer)
    getter = asyncio.ensure_future(inbox.get())
    await asyncio.wait({getter, writer}, return_when=asyncio.FIRST_COMPLETED)
    if not getter.done():
        getter.cancel()
        return await _last_word(inbox, writer)
    return getter.result()


async def _last_word(inbox: _Inbox, writer: asyncio.Task[None]) -> Shutdown | Move | Dropped:
    """The result writer stopped because the call ended. If the control plane ended it with a word
    (a Shutdown, a Move, a Dropped that says why), that word is the session's end, not the broken
    write: the reader reads to the end of the stream within moments, so wait that long for it.
    Otherwise the writer's error ends the session."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CLOSE_GRACE_S):
            while True:
                item = await inbox.get()
                if isinstance(item, Shutdown | Move | Dropped):
                    return item
                if isinstance(item, Exception):
                    break
    writer.result()  # raises what ended it
    raise StreamBroken("the result writer stopped")


async def _send_drain(link: Link, outbox: _Outbox) -> None:
    await link.draining.wait()
    log.info("drain_sent", reason=link.drain_reason)
    outbox.put_nowait(Drain(link.drain_reason))


async def _write_messages(call: grpc.aio.StreamStreamCall, outbox: _Outbox) -> None:
    """Write results (a drain, transfers received) in order until told to stop (None)."""
    while (message := await outbox.get()) is not None:
        if isinstance(message, Drain):
            proto = worker_codec.drain_to_proto(message)
        elif isinstance(message, TransferOutcome):
            proto = worker_codec.received_to_proto(message)
        elif isinstance(message, GrammarReady):
            proto = worker_codec.grammar_ready_to_proto(message)
        else:
            proto = worker_codec.result_to_proto(message)
        try:
            await call.write(proto)
        except asyncio.InvalidStateError:  # the call ended while the step ran
            raise StreamBroken("control plane closed the stream") from None


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
