"""The control plane's gRPC servers: Generation for clients, WorkerLink for workers dialling in.

Both servers carry standard health checking and server reflection. Health is NOT_SERVING until a
worker is attached and again whenever none is: a control plane without workers cannot serve.

Trust: clients may be asked for a bearer token (`--api-key`) and served over TLS; workers may be
required to present a certificate from `--worker-ca` (mutual TLS). Nothing a peer sends is believed
before it is checked: requests in codec.py, hellos and results in worker_checks.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control_plane import codec, metrics
from control_plane.config import ControlConfig, Security
from control_plane.engine import Engine
from control_plane.failover import WorkerGone
from control_plane.router import Router
from control_plane.scheduler.plan import StepPlan, StepResult
from control_plane.scheduler.scheduler import QueueFull, RequestRejected
from control_plane.streams import Chunk, Event, Submission
from control_plane.tokenizer import Tokenizer
from control_plane.worker_checks import WorkerFault, hello_refusal
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.stepwise.v1 import worker_pb2_grpc as wk_grpc

log = structlog.get_logger("stepwise.server")

VERSION = "0.1.0"
GENERATION_SERVICE = gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name
WORKER_SERVICE = wk_pb.DESCRIPTOR.services_by_name["WorkerLink"].full_name
# SO_REUSEPORT off: a second control plane on the same port fails to start instead of silently
# taking a share of the clients. Streams wait in the server rather than being cancelled.
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.server_max_unrequested_time_in_server", 3600),
]
WORKER_SERVER_OPTIONS = [
    *SERVER_OPTIONS,
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]


class StreamChannel:
    """A WorkerChannel over one worker's Connect stream: write a plan, read its result."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context

    async def step(self, plan: StepPlan) -> StepResult:
        message = codec.plan_to_proto(plan)  # a failure here is ours, not the worker's
        try:
            await self.context.write(message)
            msg = await self.context.read()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # grpc raises several types (AioRpcError, InvalidStateError, cygrpc's ExecuteBatchError)
            # for a stream that broke under us: all mean the worker is gone.
            raise WorkerGone(f"{type(exc).__name__}: {exc}") from exc
        if msg is grpc.aio.EOF or msg is None:  # type: ignore[attr-defined]
            raise WorkerGone("stream closed")
        if msg.WhichOneof("msg") != "result":
            raise WorkerFault(f"expected a step result, got {msg.WhichOneof('msg') or 'an empty message'}")
        try:
            return codec.result_from_proto(msg.result)
        except codec.ProtocolError as exc:
            raise WorkerFault(str(exc)) from None

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
        refusal = self._refusal(first.hello) or hello_refusal(
            limits, self.config.limits, self.tokenizer.vocab_size
        )
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
        if engine.fault is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"dropped: {engine.fault}")

    def _refusal(self, hello: wk_pb.Hello) -> str:
        if hello.protocol_version != codec.PROTOCOL_VERSION:
            return (
                f"protocol_version {hello.protocol_version} is not supported (want {codec.PROTOCOL_VERSION})"
            )
        if self.router.has(hello.worker_id):
            return f"worker_id {hello.worker_id!r} is already attached"
        page = self.config.scheduler.page_size
        if page is not None and hello.page_size != page:
            return f"page_size {hello.page_size} differs from the control plane's --page-size {page}"
        chunk = self.config.scheduler.chunked_prefill_size
        if page is None and chunk and hello.page_size > 0 and chunk % hello.page_size:
            # SGLang asserts the chunk is a whole number of pages (§4.1); the page is the worker's here.
            return f"page_size {hello.page_size} does not divide --chunked-prefill-size {chunk}"
        fingerprint = self.router.model_fingerprint
        if fingerprint and hello.model_fingerprint != fingerprint:
            return "model_fingerprint differs from the workers already attached"
        return ""


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


class GenerationService(gen_grpc.GenerationServicer):
    def __init__(self, config: ControlConfig, tokenizer: Tokenizer, router: Router) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.router = router
        self.keys = ApiKeys(config.security.api_keys)

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
        engine, submission = await self._accept(request, context, caller)
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
        self,
        request: gen_pb.GenerateRequest | codec.Unparsable,
        context: grpc.aio.ServicerContext,
        caller: Caller,
    ) -> tuple[Engine, Submission]:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(request, codec.Unparsable):
            await context.abort(invalid, request.reason)
        assert not isinstance(request, codec.Unparsable)
        try:
            inp = codec.generate_input_from_proto(request, self.config.limits)
        except codec.InvalidArgument as exc:
            await context.abort(invalid, str(exc))
        if inp.request_id and self.router.find(inp.request_id) is not None:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {inp.request_id!r} is in use")
        engine = self.router.pick(inp.params.routing_key)
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is attached to the control plane")
        assert engine is not None
        try:
            ids = await self._prompt_ids(inp, engine)
        except codec.InvalidArgument as exc:
            await context.abort(invalid, str(exc))
        rid = inp.request_id or uuid.uuid4().hex
        try:
            submission = engine.submit(rid, ids, inp.params, inp.n, caller.owner)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {exc}")
        await self._wait_accepted(engine, submission, context)
        return engine, submission

    async def _prompt_ids(self, inp: codec.GenerateInput, engine: Engine) -> list[int]:
        """The prompt's token ids, checked. Text is measured before it is tokenized, and tokenized off
        the event loop: its cost grows with its length."""
        if inp.text is not None:
            self._check_text_fits(inp.text, engine)
            ids = await asyncio.to_thread(self.tokenizer.encode, inp.text)
            field_name = "text"
        else:
            ids, field_name = list(inp.input_ids or ()), "input_ids"
        if not ids:
            raise codec.InvalidArgument(f"{field_name}: prompt must not be empty")
        codec.check_token_ids(ids, engine.limits.vocab_size)
        error = engine.scheduler.input_length_error(len(ids))
        if error and not self.config.scheduler.allow_auto_truncate:
            raise codec.InvalidArgument(f"{field_name}: {error}")
        return ids

    def _check_text_fits(self, text: str, engine: Engine) -> None:
        if self.config.scheduler.allow_auto_truncate:
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        context_len = engine.limits.max_context
        if size > context_len * self.tokenizer.max_token_bytes:
            raise codec.InvalidArgument(
                f"text: a prompt of {size} bytes is more than the model's context of {context_len} tokens"
            )

    async def _wait_accepted(
        self, engine: Engine, submission: Submission, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            await submission.accepted
        except asyncio.CancelledError:
            engine.abort(submission.rid, "cancelled by the client")
            raise
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RequestRejected as exc:
            # SGLang answers 503 here (§1.5 _add_request_to_queue): the server refuses, the input is fine.
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {exc}")
        except Exception:
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the control plane (logged)")

    async def Abort(
        self, request: gen_pb.AbortRequest | codec.Unparsable, context: grpc.aio.ServicerContext
    ) -> gen_pb.AbortResponse:
        caller = await self._caller(context)
        if isinstance(request, codec.Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        assert not isinstance(request, codec.Unparsable)
        engine = self.router.find(request.request_id)
        # Someone else's request is reported as not found: its id tells the caller nothing.
        if engine is None or engine.owner_of(request.request_id) != caller.owner:
            return gen_pb.AbortResponse(found=False)
        return gen_pb.AbortResponse(found=engine.abort(request.request_id, "aborted by an Abort call"))

    async def GetServerInfo(
        self, request: gen_pb.GetServerInfoRequest | codec.Unparsable, context: grpc.aio.ServicerContext
    ) -> gen_pb.ServerInfo:
        caller = await self._caller(context)
        info = self.router.server_info(self.config, self.tokenizer, VERSION)
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
        self.client_server = grpc.aio.server(options=SERVER_OPTIONS)
        self.worker_server = grpc.aio.server(options=WORKER_SERVER_OPTIONS)
        self.port = 0
        self.worker_port = 0

    async def start(self) -> None:
        self.client_server.add_generic_rpc_handlers(
            (generation_handler(GenerationService(self.config, self.tokenizer, self.router)),)
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
        client_creds, worker_creds = server_credentials(self.config.security)
        self.port = _bind(self.client_server, self.config.host, self.config.port, client_creds)
        self.worker_port = _bind(self.worker_server, self.config.host, self.config.worker_port, worker_creds)
        await self._set_health(False)
        metrics.serve(self.config.metrics_port, self.config.host)
        await self.client_server.start()
        await self.worker_server.start()
        log.info(
            "control plane listening",
            port=self.port,
            worker_port=self.worker_port,
            model=str(self.config.model_dir),
            client_tls=self.config.security.client_tls,
            worker_mtls=self.config.security.worker_ca is not None,
            api_keys=len(self.config.security.api_keys),
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


def server_credentials(
    security: Security,
) -> tuple[grpc.ServerCredentials | None, grpc.ServerCredentials | None]:
    """(client port, worker port) credentials: None for plaintext. The worker port asks for client
    certificates chaining to --worker-ca and refuses connections without one."""
    if security.tls_cert is None or security.tls_key is None:
        return None, None
    pair = [(security.tls_key.read_bytes(), security.tls_cert.read_bytes())]
    client = grpc.ssl_server_credentials(pair)
    if security.worker_ca is None:
        return client, None
    worker = grpc.ssl_server_credentials(
        pair, root_certificates=security.worker_ca.read_bytes(), require_client_auth=True
    )
    return client, worker


def _bind(server: grpc.aio.Server, host: str, port: int, creds: grpc.ServerCredentials | None) -> int:
    """Bind `host:port` (0 picks a free port); OSError naming the address when it cannot be had."""
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    _probe(host, port, address)
    try:
        bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address} (is another server using it?)") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {address} (is another server using it?)")
    return bound


def _probe(host: str, port: int, address: str) -> None:
    """Try the address with a plain socket first: a taken port is then one clear OSError, rather than
    gRPC's own error log followed by one."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is fine
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            raise OSError(
                f"cannot listen on {address}: {exc.strerror} (is another server using it?)"
            ) from None
