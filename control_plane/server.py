"""The control plane's gRPC servers: Generation for clients, WorkerLink for workers dialling in.

Both servers carry standard health checking and server reflection. Health is NOT_SERVING until a
worker is attached and again whenever none is: a control plane without workers cannot serve.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control_plane import codec, metrics
from control_plane.config import ControlConfig
from control_plane.engine import Chunk, Engine, Event, Submission, WorkerGone
from control_plane.router import Router
from control_plane.scheduler.plan import StepPlan, StepResult
from control_plane.scheduler.scheduler import QueueFull, RequestRejected
from control_plane.tokenizer import Tokenizer
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.stepwise.v1 import worker_pb2_grpc as wk_grpc

log = structlog.get_logger("stepwise.server")

VERSION = "0.1.0"
GENERATION_SERVICE = gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name
WORKER_SERVICE = wk_pb.DESCRIPTOR.services_by_name["WorkerLink"].full_name


class StreamChannel:
    """A WorkerChannel over one worker's Connect stream: write a plan, read its result."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context

    async def step(self, plan: StepPlan) -> StepResult:
        try:
            await self.context.write(codec.plan_to_proto(plan))
            msg = await self.context.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError) as exc:
            raise WorkerGone(str(exc)) from exc
        if msg is grpc.aio.EOF or msg is None:  # type: ignore[attr-defined]
            raise WorkerGone("stream closed")
        if msg.WhichOneof("msg") != "result":
            raise WorkerGone(f"expected a step result, got {msg.WhichOneof('msg')}")
        return codec.result_from_proto(msg.result)

    async def close(self, reason: str) -> None:
        await self.context.write(codec.shutdown(reason))


class WorkerLinkService(wk_grpc.WorkerLinkServicer):
    def __init__(self, config: ControlConfig, tokenizer: Tokenizer, router: Router) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.router = router

    async def Connect(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("msg") != "hello":  # type: ignore[attr-defined]
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the first message must be a hello")
            return
        limits = codec.limits_from_hello(first.hello)
        refusal = self._refusal(first.hello)
        if refusal:
            log.error("worker refused", worker=limits.worker_id, reason=refusal)
            await context.write(codec.welcome(False, refusal))
            return
        engine = Engine(self.config, limits, self.tokenizer, StreamChannel(context))
        engine.successor = self.router.successor
        await context.write(codec.welcome(True))
        log.info(
            "worker attached",
            worker=limits.worker_id,
            kv_capacity_tokens=limits.kv_capacity_tokens,
            page_size=engine.scheduler.page_size,
            max_context=limits.max_context,
            device=limits.device,
            dtype=limits.dtype,
            max_running_requests=engine.scheduler.max_running_requests,
            chunked_prefill_size=self.config.scheduler.chunked_prefill_size,
            max_prefill_tokens=self.config.scheduler.max_prefill_tokens,
        )
        self.router.attach(engine)
        try:
            await engine.run()
        finally:
            self.router.detach(engine)
            log.info("worker detached", worker=limits.worker_id)

    def _refusal(self, hello: wk_pb.Hello) -> str:
        if hello.protocol_version != codec.PROTOCOL_VERSION:
            return (
                f"protocol_version {hello.protocol_version} is not supported (want {codec.PROTOCOL_VERSION})"
            )
        if self.router.has(hello.worker_id):
            return f"worker_id {hello.worker_id!r} is already attached"
        if hello.kv_capacity_tokens <= 0:
            return "kv_capacity_tokens must be > 0"
        page = self.config.scheduler.page_size
        if page is not None and hello.page_size != page:
            return f"page_size {hello.page_size} differs from the control plane's --page-size {page}"
        if hello.vocab_size < self.tokenizer.vocab_size:
            return (
                f"vocab_size {hello.vocab_size} is smaller than the tokenizer's {self.tokenizer.vocab_size}"
            )
        fingerprint = self.router.model_fingerprint
        if fingerprint and hello.model_fingerprint != fingerprint:
            return "model_fingerprint differs from the workers already attached"
        return ""


class GenerationService(gen_grpc.GenerationServicer):
    def __init__(self, config: ControlConfig, tokenizer: Tokenizer, router: Router) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.router = router

    async def Generate(
        self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gen_pb.GenerateResponse]:
        engine, submission = await self._accept(request, context)
        remaining = len(submission.rids)
        try:
            while remaining:
                events = [await submission.events.get()]
                while not submission.events.empty():
                    events.append(submission.events.get_nowait())
                for response in _coalesce(submission.rid, events):
                    yield response
                    remaining -= response.WhichOneof("event") == "finished"
        finally:
            if remaining:
                engine.abort(submission.rid, "cancelled by the client")

    async def _accept(
        self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[Engine, Submission]:
        try:
            inp = codec.generate_input_from_proto(request)
        except codec.InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        engine = self.router.pick(inp.params.routing_key)
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is attached to the control plane")
        assert engine is not None
        field_name = "text" if inp.text is not None else "input_ids"
        ids = list(inp.input_ids) if inp.input_ids is not None else self.tokenizer.encode(inp.text or "")
        try:
            if not ids:
                raise codec.InvalidArgument(f"{field_name}: prompt must not be empty")
            codec.check_token_ids(ids, engine.limits.vocab_size)
            error = engine.scheduler.input_length_error(len(ids))
            if error and not self.config.scheduler.allow_auto_truncate:
                raise codec.InvalidArgument(f"{field_name}: {error}")
        except codec.InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rid = inp.request_id or uuid.uuid4().hex
        try:
            submission = engine.submit(rid, ids, inp.params, inp.n)
            await submission.accepted
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RequestRejected as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {exc}")
        return engine, submission

    async def Abort(
        self, request: gen_pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.AbortResponse:
        engine = self.router.find(request.request_id)
        found = engine is not None and engine.abort(request.request_id, "aborted by an Abort call")
        return gen_pb.AbortResponse(found=found)

    async def GetServerInfo(
        self, request: gen_pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.ServerInfo:
        return self.router.server_info(self.config, self.tokenizer, VERSION)


def _coalesce(rid: str, events: list[Event]) -> list[gen_pb.GenerateResponse]:
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


class ControlPlane:
    """Both servers, the router and health; `start()` binds, `stop()` drains and closes."""

    def __init__(self, config: ControlConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or Tokenizer.from_dir(config.model_dir)
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.router = Router(model_name=str(config.model_dir), on_change=self._on_workers_changed)
        self.client_server = grpc.aio.server()
        self.worker_server = grpc.aio.server()
        self.port = 0
        self.worker_port = 0

    async def start(self) -> None:
        gen_grpc.add_GenerationServicer_to_server(
            GenerationService(self.config, self.tokenizer, self.router), self.client_server
        )
        wk_grpc.add_WorkerLinkServicer_to_server(
            WorkerLinkService(self.config, self.tokenizer, self.router), self.worker_server
        )
        for server, service in (
            (self.client_server, GENERATION_SERVICE),
            (self.worker_server, WORKER_SERVICE),
        ):
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            reflection.enable_server_reflection(
                (service, health.SERVICE_NAME, reflection.SERVICE_NAME), server
            )
        self.port = self.client_server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        self.worker_port = self.worker_server.add_insecure_port(
            f"{self.config.host}:{self.config.worker_port}"
        )
        await self._set_health(False)
        metrics.serve(self.config.metrics_port, self.config.host)
        await self.client_server.start()
        await self.worker_server.start()
        log.info(
            "control plane listening",
            port=self.port,
            worker_port=self.worker_port,
            model=str(self.config.model_dir),
        )

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", GENERATION_SERVICE):
            await self.health.set(name, status)

    def _on_workers_changed(self, count: int) -> None:
        asyncio.get_running_loop().create_task(self._set_health(count > 0))

    async def stop(self, grace: float = 2.0) -> None:
        await self._set_health(False)
        self.router.stop_all()
        await self.client_server.stop(grace)
        await self.worker_server.stop(grace)

    async def wait(self) -> None:
        await self.client_server.wait_for_termination()
