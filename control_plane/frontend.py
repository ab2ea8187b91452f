"""A frontend process: the client-facing half of `stepwise control` (SGLang's TokenizerManager and
DetokenizerManager in one).

`stepwise control --frontends K` runs K of these beside the core. Each serves the Generation API on
the shared client port (SO_REUSEPORT among them only; see supervisor.py): it authenticates,
validates, tokenizes, sends arrivals, aborts and stop-string finishes to the core, and turns the
core's token batches into client messages (samples.py). It makes no scheduling decision: the core
decides, and records what it saw when it saw it, so replays are unaffected by how many frontends
there are.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import itertools
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import numpy as np
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control_plane import codec, metrics
from control_plane.config import ControlConfig
from control_plane.inbox import UID_LINK_SHIFT
from control_plane.link import FrameReader, FrameWriter, LinkClosed, TurnFlush
from control_plane.listen import bind, server_credentials
from control_plane.request import AbortCode, FinishKind, FinishReason
from control_plane.samples import Call, Chunk, Event, Sample
from control_plane.tokenizer import TextStream, Tokenizer
from protos.stepwise.v1 import frontend_pb2 as fe_pb
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc

log = structlog.get_logger("stepwise.frontend")

GENERATION_SERVICE = gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name
# Text prompts up to this size are tokenized on the event loop (tens of microseconds); longer ones
# in a thread, so no client's prompt stalls the others' streams.
INLINE_TOKENIZE_BYTES = 2048
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
CORE_GONE = "the control plane's core went away; retry"


def server_options(reuse_port: bool) -> list[tuple[str, int]]:
    """Options for a client-facing gRPC server sized for many concurrent streams.

    gRPC cancels calls that wait unrequested longer than `server_max_unrequested_time_in_server`
    (30 s by default) and rejects calls beyond its pending-request limits (1000 soft, 3000 hard):
    past ~2,000 concurrent streams clients saw CANCELLED. Calls wait instead, and beyond
    --max-concurrent-streams they get RESOURCE_EXHAUSTED (grpc.aio's maximum_concurrent_rpcs).
    """
    return [
        ("grpc.so_reuseport", int(reuse_port)),
        ("grpc.server_max_unrequested_time_in_server", 3600),
        ("grpc.server.max_pending_requests", 1 << 20),
        ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
    ]


# --- who is calling ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: an API key's id when keys are on, else the client's connection."""

    owner: str
    authenticated: bool


class ApiKeys:
    """Bearer tokens accepted from clients. A key is known by a short hash of it, never by itself."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def identify(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
        """The caller's key id, or None when it sent no known key (compared in constant time)."""
        token = _bearer(metadata)
        if token is None:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        match = None
        for known in self._digests:
            if hmac.compare_digest(digest, known):
                match = known
        return None if match is None else "key:" + match.hex()[:12]


def _bearer(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :].strip()
    return None


# --- the link to the core ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class CoreState:
    """What the core last said about the control plane: can it serve, and within which limits."""

    workers: int = 0
    max_context: int = 0
    vocab_size: int = 0


class Frontend:
    """Calls and samples of one frontend process, and the link that feeds them.

    Everything here runs on the frontend's event loop. Outgoing parts (arrivals, aborts, stops,
    queries) are merged into one FrontendMessage per loop turn; each CoreMessage is applied whole.
    """

    def __init__(self, config: ControlConfig, tokenizer: Tokenizer, index: int = 0) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.index = index
        self.state = CoreState()
        self.link_id = 0
        self._uids = itertools.count(1)
        self.samples: dict[int, Sample] = {}
        # Calls waiting for the core's verdict, by their first uid.
        self._awaiting: dict[int, Call] = {}
        self._queries: dict[int, asyncio.Future[fe_pb.Reply]] = {}
        self._query_ids = itertools.count(1)
        self._outbox = fe_pb.FrontendMessage()
        self._flush = TurnFlush(self._send_outbox)
        self._writer: FrameWriter | None = None
        # Called with the new state whenever the core sends one (health follows it).
        self.on_state: list[Callable[[CoreState], None]] = []
        self.closed = asyncio.Event()

    # --- connecting ------------------------------------------------------------------------------

    async def connect(self, path: str) -> None:
        """Dial the core, say hello and wait for the welcome; then read its messages in a task."""
        reader, writer = await asyncio.open_unix_connection(path)
        self._writer = FrameWriter(writer)
        hello = fe_pb.FrontendMessage(hello=fe_pb.FrontendHello(index=self.index, pid=os.getpid()))
        self._writer.write(hello)
        frames = FrameReader(reader, fe_pb.CoreMessage)
        first = await frames.read()
        if not first.HasField("welcome"):
            raise LinkClosed("the core's first message is not a welcome")
        self.link_id = first.welcome.link_id
        self.apply(first)
        self._reader = asyncio.create_task(self._read(frames))

    async def _read(self, frames: FrameReader[fe_pb.CoreMessage]) -> None:
        try:
            while True:
                self.apply(await frames.read())
        except LinkClosed as exc:
            log.error("lost the core", error=str(exc))
        except Exception:
            log.exception("applying a core message failed")
        finally:
            self._end_everything(CORE_GONE)
            self.closed.set()

    def _send_outbox(self) -> None:
        message, self._outbox = self._outbox, fe_pb.FrontendMessage()
        if self._writer is None or self._writer.closed:
            return
        try:
            self._writer.write(message)
        except LinkClosed as exc:
            log.error("cannot write to the core", error=str(exc))

    def _outgoing(self) -> fe_pb.FrontendMessage:
        self._flush.request()
        return self._outbox

    # --- calls -------------------------------------------------------------------------------------

    def open_call(
        self,
        inp: codec.GenerateInput,
        sampling: gen_pb.SamplingParams,
        rid: str,
        ids: list[int],
        owner: str,
    ) -> Call:
        """Register a call's samples and send its arrival; `call.verdict` resolves with the core's
        answer. `sampling` is the client's message, which `inp` was checked from."""
        call = Call(rid=rid, owner=owner, arrived=time.monotonic())
        call.verdict = asyncio.get_running_loop().create_future()
        params = inp.params
        for index in range(inp.n):
            uid = (self.link_id << UID_LINK_SHIFT) | next(self._uids)
            text = TextStream(self.tokenizer, ids, params.stop, min_new_tokens=params.min_new_tokens)
            sample = Sample(uid, call, index, len(ids), text, has_stops=bool(params.stop))
            call.samples.append(sample)
            self.samples[uid] = sample
        self._awaiting[call.samples[0].uid] = call
        self._outgoing().arrivals.append(_arrival(inp, sampling, call, ids))
        return call

    def cancel(self, call: Call, message: str) -> None:
        """The client went away: the core aborts what is left of the call; its events are dropped."""
        self.forget(call)
        if call.verdict is not None and not call.verdict.done():
            call.verdict.cancel()
        self._outgoing().aborts.add(request_id=call.rid, owner=call.owner, message=message, cancelled=True)

    def forget(self, call: Call) -> None:
        self._awaiting.pop(call.samples[0].uid, None)
        for sample in call.samples:
            sample.done = True
            self.samples.pop(sample.uid, None)

    async def abort(self, request_id: str, owner: str) -> bool:
        """An Abort call: whether the core found a live request of this owner by that id."""
        query_id = next(self._query_ids)
        self._outgoing().aborts.add(
            request_id=request_id, owner=owner, message="aborted by an Abort call", query_id=query_id
        )
        return (await self._reply(query_id)).abort.found

    async def server_info(self) -> gen_pb.ServerInfo:
        query_id = next(self._query_ids)
        self._outgoing().queries.add(query_id=query_id).server_info.SetInParent()
        return (await self._reply(query_id)).server_info

    async def _reply(self, query_id: int) -> fe_pb.Reply:
        if self.closed.is_set():
            raise LinkClosed(CORE_GONE)
        future: asyncio.Future[fe_pb.Reply] = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future
        try:
            return await future
        finally:
            self._queries.pop(query_id, None)

    # --- what the core says ------------------------------------------------------------------------

    def apply(self, msg: fe_pb.CoreMessage) -> None:
        if msg.HasField("state"):
            self.state = CoreState(msg.state.workers, msg.state.max_context, msg.state.vocab_size)
            for callback in self.on_state:
                callback(self.state)
        for verdict in msg.verdicts:
            self._verdict(verdict)
        for admission in msg.admissions:
            sample = self.samples.get(admission.uid)
            if sample is not None and sample.admitted is None:
                sample.admitted, sample.cached_tokens = admission.admitted, admission.cached_tokens
                sample.worker = admission.worker
        if msg.token_uids:
            self._tokens(msg.token_uids, msg.token_ids)
        for finished in msg.finished:
            self._finished(finished)
        for reply in msg.replies:
            future = self._queries.get(reply.query_id)
            if future is not None and not future.done():
                future.set_result(reply)

    def _verdict(self, verdict: fe_pb.Verdict) -> None:
        call = self._awaiting.pop(verdict.uid, None)
        if call is None or call.verdict is None or call.verdict.done():
            return
        if verdict.code != grpc.StatusCode.OK.value[0]:
            self.forget(call)
        call.verdict.set_result((verdict.code, verdict.message))

    def _tokens(self, uid_bytes: bytes, token_bytes: bytes) -> None:
        uids = np.frombuffer(uid_bytes, dtype="<u8").tolist()
        tokens = np.frombuffer(token_bytes, dtype="<i4").tolist()
        samples, touched = self.samples, {}
        for uid, token in zip(uids, tokens, strict=True):
            sample = samples.get(uid)
            if sample is None or sample.done:
                continue  # ended here already (a stop string, a cancelled call): discarded
            stop = sample.receive(token)
            if stop is not None:
                self._stopped(sample, stop)
            else:
                touched[uid] = sample
        interval = self.config.stream_interval
        for sample in touched.values():
            if not sample.done and sample.message_due(interval):
                self._message(sample)

    def _message(self, sample: Sample) -> None:
        last, first = sample.last_message, sample.first_token
        chunk = sample.flush()
        if chunk is None:
            return
        _observe_message(sample, chunk, last, first)
        sample.call.events.put_nowait(chunk)

    def _stopped(self, sample: Sample, stop: str) -> None:
        """A stop string ended the sample here; the core finishes it one step late."""
        self._outgoing().stops.add(uid=sample.uid, stop=stop)
        self._end(sample, FinishReason.stop(f"stop string {stop!r}"))

    def _finished(self, msg: fe_pb.LinkFinished) -> None:
        sample = self.samples.get(msg.uid)
        if sample is None or sample.done:
            return
        if not sample.admitted:
            sample.cached_tokens = msg.cached_tokens
        code = AbortCode(msg.code) if msg.code else None
        self._end(sample, FinishReason(FinishKind(msg.kind), msg.message, code))

    def _end(self, sample: Sample, reason: FinishReason) -> None:
        last, first = sample.last_message, sample.first_token
        events = sample.finish(reason)
        for event in events:
            if isinstance(event, Chunk):
                _observe_message(sample, event, last, first)
            sample.call.events.put_nowait(event)
        metrics.E2E_LATENCY.labels(sample.worker).observe(time.monotonic() - sample.call.arrived)
        self.samples.pop(sample.uid, None)

    def _end_everything(self, message: str) -> None:
        for call in {id(s.call): s.call for s in self.samples.values()}.values():
            if call.verdict is not None and not call.verdict.done():
                call.verdict.set_result((grpc.StatusCode.UNAVAILABLE.value[0], message))
        for sample in list(self.samples.values()):
            self._end(sample, FinishReason.abort(message))
        for future in self._queries.values():
            if not future.done():
                future.set_exception(LinkClosed(message))


def _observe_message(sample: Sample, chunk: Chunk, last: float, first: float | None) -> None:
    """TTFT at a sample's first message; the inter-token latency of later messages, per token."""
    now = sample.last_message
    if first is None:
        metrics.TTFT.labels(sample.worker).observe(now - sample.call.arrived)
    elif chunk.token_ids:
        metrics.ITL.labels(sample.worker).observe((now - last) / len(chunk.token_ids))


def _arrival(
    inp: codec.GenerateInput, sampling: gen_pb.SamplingParams, call: Call, ids: list[int]
) -> fe_pb.Arrival:
    params = inp.params
    return fe_pb.Arrival(
        request_id=call.rid,
        uids=[s.uid for s in call.samples],
        input_ids=np.asarray(ids, dtype="<i4").tobytes(),
        sampling=sampling,
        routing_key=params.routing_key,
        has_priority=params.priority is not None,
        priority=params.priority or 0,
        owner=call.owner,
        arrived=call.arrived,
        prompt_field="text" if inp.text is not None else "input_ids",
    )


# --- the Generation service ----------------------------------------------------------------------


class GenerationService(gen_grpc.GenerationServicer):
    """Generate, Abort and GetServerInfo for clients, served by one frontend."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.config = frontend.config
        self.tokenizer = frontend.tokenizer
        self.keys = ApiKeys(self.config.security.api_keys)

    async def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """Authenticate the call, or end it with UNAUTHENTICATED."""
        if not self.keys.enabled:
            return Caller(owner=context.peer(), authenticated=False)
        owner = self.keys.identify(context.invocation_metadata())  # type: ignore[arg-type]
        if owner is None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key (send authorization: Bearer KEY)"
            )
        assert owner is not None
        return Caller(owner=owner, authenticated=True)

    async def Generate(
        self, request: gen_pb.GenerateRequest | codec.Unparsable, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gen_pb.GenerateResponse]:
        caller = await self._caller(context)
        call = await self._accept(request, context, caller)
        remaining = len(call.samples)
        try:
            while remaining:
                events = [await call.events.get()]
                while not call.events.empty():
                    events.append(call.events.get_nowait())
                for response in coalesce(call.rid, events):
                    yield response
                    remaining -= response.WhichOneof("event") == "finished"
        finally:
            if remaining:
                self.frontend.cancel(call, "cancelled by the client")

    async def _accept(
        self,
        request: gen_pb.GenerateRequest | codec.Unparsable,
        context: grpc.aio.ServicerContext,
        caller: Caller,
    ) -> Call:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(request, codec.Unparsable):
            await context.abort(invalid, request.reason)
        assert not isinstance(request, codec.Unparsable)
        try:
            inp = codec.generate_input_from_proto(request, self.config.limits)
        except codec.InvalidArgument as exc:
            await context.abort(invalid, str(exc))
        state = self.frontend.state
        if not state.workers:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is attached to the control plane")
        try:
            ids = await self._prompt_ids(inp, state)
        except codec.InvalidArgument as exc:
            await context.abort(invalid, str(exc))
        rid = inp.request_id or uuid.uuid4().hex
        call = self.frontend.open_call(inp, request.sampling, rid, ids, caller.owner)
        assert call.verdict is not None
        try:
            code, message = await call.verdict
        except asyncio.CancelledError:
            self.frontend.cancel(call, "cancelled by the client")
            raise
        if code != grpc.StatusCode.OK.value[0]:
            await context.abort(_STATUS.get(code, grpc.StatusCode.INTERNAL), message)
        return call

    async def _prompt_ids(self, inp: codec.GenerateInput, state: CoreState) -> list[int]:
        """The prompt's token ids, checked. Text is measured before it is tokenized, and long text is
        tokenized off the event loop: its cost grows with its length."""
        if inp.text is not None:
            size = self._check_text_fits(inp.text, state)
            if size <= INLINE_TOKENIZE_BYTES:
                ids = self.tokenizer.encode(inp.text)
            else:
                ids = await asyncio.to_thread(self.tokenizer.encode, inp.text)
            field_name = "text"
        else:
            ids, field_name = list(inp.input_ids or ()), "input_ids"
        if not ids:
            raise codec.InvalidArgument(f"{field_name}: prompt must not be empty")
        codec.check_token_ids(ids, state.vocab_size or self.tokenizer.vocab_size)
        return ids

    def _check_text_fits(self, text: str, state: CoreState) -> int:
        size = len(text.encode("utf-8", "surrogatepass"))
        if self.config.scheduler.allow_auto_truncate or not state.max_context:
            return size
        if size > state.max_context * self.tokenizer.max_token_bytes:
            raise codec.InvalidArgument(
                f"text: a prompt of {size} bytes is more than the model's context of "
                f"{state.max_context} tokens"
            )
        return size

    async def Abort(
        self, request: gen_pb.AbortRequest | codec.Unparsable, context: grpc.aio.ServicerContext
    ) -> gen_pb.AbortResponse:
        caller = await self._caller(context)
        if isinstance(request, codec.Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        assert not isinstance(request, codec.Unparsable)
        try:
            found = await self.frontend.abort(request.request_id, caller.owner)
        except LinkClosed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, CORE_GONE)
        return gen_pb.AbortResponse(found=found)

    async def GetServerInfo(
        self, request: gen_pb.GetServerInfoRequest | codec.Unparsable, context: grpc.aio.ServicerContext
    ) -> gen_pb.ServerInfo:
        caller = await self._caller(context)
        try:
            info = await self.frontend.server_info()
        except LinkClosed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, CORE_GONE)
        if not caller.authenticated:
            # No filesystem paths or weight fingerprints to callers we do not know.
            info.model = Path(info.model).name
            info.model_fingerprint = ""
        return info


def generation_handler(service: GenerationService) -> grpc.GenericRpcHandler:
    """The Generation service, parsing requests leniently (see codec.lenient_parser)."""
    methods = gen_pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name
    handlers = {}
    for name, method in methods.items():
        request_cls = getattr(gen_pb, method.input_type.name)
        response_cls = getattr(gen_pb, method.output_type.name)
        factory = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[name] = factory(
            getattr(service, name),
            request_deserializer=codec.lenient_parser(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers)


def coalesce(rid: str, events: list[Event]) -> list[gen_pb.GenerateResponse]:
    """Merge consecutive chunks of a sample into one message (a slow reader gets fewer, larger ones)."""
    out: list[gen_pb.GenerateResponse] = []
    pending: Chunk | None = None
    for event in events:
        if isinstance(event, Chunk):
            if pending is not None and pending.index == event.index:
                pending = Chunk(event.index, pending.token_ids + event.token_ids, pending.text + event.text)
                continue
            _flush_chunk(rid, pending, out)
            pending = event
            continue
        _flush_chunk(rid, pending, out)
        pending = None
        out.append(
            codec.finished_response(
                rid,
                event.index,
                event.reason,
                (event.prompt_tokens, event.cached_tokens, event.completion_tokens),
                (event.queue_s, event.ttft_s, event.total_s),
            )
        )
    _flush_chunk(rid, pending, out)
    return out


def _flush_chunk(rid: str, chunk: Chunk | None, out: list[gen_pb.GenerateResponse]) -> None:
    if chunk is not None and (chunk.token_ids or chunk.text):
        out.append(codec.chunk_response(rid, chunk.index, list(chunk.token_ids), chunk.text))


# --- the process ---------------------------------------------------------------------------------


class FrontendServer:
    """One frontend: the link to the core and a gRPC server on the client port with health and
    reflection. Health is SERVING while the core has a worker attached."""

    def __init__(self, config: ControlConfig, index: int, reuse_port: bool = True) -> None:
        self.config = config
        self.frontend = Frontend(config, Tokenizer.from_dir(config.model_dir), index)
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.server = grpc.aio.server(
            options=server_options(reuse_port), maximum_concurrent_rpcs=config.max_concurrent_streams
        )
        self.port = 0

    async def start(self, link_path: str, port: int) -> int:
        """Listen on `port` (the core holds it until every frontend listens; see listen.py), then dial
        the core. Until the core's state arrives, health says NOT_SERVING and calls are refused."""
        self.server.add_generic_rpc_handlers((generation_handler(GenerationService(self.frontend)),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        client_creds, _ = server_credentials(self.config.security)
        self.port = bind(self.server, self.config.host, port, client_creds, probe=False)
        await self._set_health(False)
        await self.server.start()
        self.frontend.on_state.append(self._on_state)
        await self.frontend.connect(link_path)
        await self._set_health(self.frontend.state.workers > 0)
        return self.port

    def _on_state(self, state: CoreState) -> None:
        asyncio.get_running_loop().create_task(self._set_health(state.workers > 0))

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", GENERATION_SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace: float = 2.0) -> None:
        await self._set_health(False)
        await self.server.stop(grace)


async def serve(config: ControlConfig, index: int, link_path: str, port: int) -> int:
    """Run one frontend until SIGTERM/SIGINT or until the core goes away."""
    server = FrontendServer(config, index)
    await server.start(link_path, port)
    log.info("frontend listening", index=index, port=server.port, pid=os.getpid())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(server.frontend.closed.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    await server.stop()
    return 0 if stop.is_set() else 1


def main(config: ControlConfig, index: int, link_path: str, port: int, log_level: str, parent: int) -> None:
    """Process entry (started by the supervisor with multiprocessing's spawn; `parent` is the core)."""
    from stepwise import logs
    from stepwise.parent import die_with_parent_pid

    die_with_parent_pid(parent)
    logs.configure(log_level)
    structlog.contextvars.bind_contextvars(frontend=index)
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(serve(config, index, link_path, port)))
