"""The control plane's core process: the worker dial-in service (one engine per attached worker),
the hub its frontends link to, and the frontend processes themselves (DESIGN: "Processes and scale").

Clients reach the frontends on the client port; workers dial the core's worker port. Both ports carry
standard health checking and server reflection. Health is NOT_SERVING until a worker is attached and
again whenever none is: a control plane without workers cannot serve.

Trust: clients may be asked for a bearer token (`--api-key`) and served over TLS (generation.py);
workers may be required to present a certificate from `--worker-ca` (mutual TLS). Nothing a peer
sends is believed before it is checked: requests in codec.py, hellos and results in worker_checks.py.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control_plane import codec, metrics
from control_plane.config import ControlConfig
from control_plane.engine import Engine
from control_plane.hub import FrontendHub
from control_plane.listen import bind, server_credentials
from control_plane.router import Router
from control_plane.supervisor import Frontends
from control_plane.tokenizer import Tokenizer
from control_plane.worker_checks import hello_refusal
from control_plane.worker_link import StreamChannel
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.stepwise.v1 import worker_pb2_grpc as wk_grpc

log = structlog.get_logger("stepwise.server")

VERSION = "0.1.0"
WORKER_SERVICE = wk_pb.DESCRIPTOR.services_by_name["WorkerLink"].full_name
GENERATION_SERVICE = gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name
# SO_REUSEPORT off: a second control plane on the same port fails to start. Streams wait in the
# server rather than being cancelled.
WORKER_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.server_max_unrequested_time_in_server", 3600),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]


class WorkerLinkService(wk_grpc.WorkerLinkServicer):
    def __init__(self, config: ControlConfig, tokenizer: Tokenizer, router: Router, hub: FrontendHub) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.router = router
        self.hub = hub

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
        engine = Engine(self.config, limits, StreamChannel(context), self.hub)
        engine.successor = self.router.successor
        # Attached before the welcome: a call that follows the welcome at once finds the worker.
        self.router.attach(engine)
        try:
            await context.write(codec.welcome(True))
        except BaseException:
            self.router.detach(engine)
            raise
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
            overlap=self.config.overlap,
        )
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


class ControlPlane:
    """The core and its frontends; `start()` binds both ports, `stop()` ends everything."""

    def __init__(self, config: ControlConfig, log_level: str = "info") -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.router = Router(model_name=str(config.model_dir), on_change=self._on_workers_changed)
        self.hub = FrontendHub(config, self.router, self.server_info)
        self.worker_server = grpc.aio.server(options=WORKER_SERVER_OPTIONS)
        self._dir = tempfile.mkdtemp(prefix="stepwise-core-")
        self.frontends = Frontends(config, str(Path(self._dir) / "link.sock"), log_level)
        self.port = 0
        self.worker_port = 0

    def server_info(self) -> gen_pb.ServerInfo:
        return self.router.server_info(self.config, self.tokenizer, VERSION)

    async def start(self) -> None:
        await self.hub.start(self.frontends.link_path)
        wk_grpc.add_WorkerLinkServicer_to_server(
            WorkerLinkService(self.config, self.tokenizer, self.router, self.hub), self.worker_server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.worker_server)
        reflection.enable_server_reflection(
            (WORKER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.worker_server
        )
        _, worker_creds = server_credentials(self.config.security)
        self.worker_port = bind(self.worker_server, self.config.host, self.config.worker_port, worker_creds)
        await self._set_health(False)
        await self.worker_server.start()
        self.port = await self.frontends.start(self.hub.connected)
        metrics.serve(self.config.metrics_port, self.config.host)
        log.info(
            "control plane listening",
            port=self.port,
            worker_port=self.worker_port,
            frontends=self.config.frontends,
            model=str(self.config.model_dir),
            client_tls=self.config.security.client_tls,
            worker_mtls=self.config.security.worker_ca is not None,
            api_keys=len(self.config.security.api_keys),
        )

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", WORKER_SERVICE):
            await self.health.set(name, status)

    def _on_workers_changed(self, count: int) -> None:
        self.hub.broadcast_state()
        asyncio.get_running_loop().create_task(self._set_health(count > 0))

    async def stop(self, grace: float = 2.0) -> None:
        """Stop the engines (every live request ends with an abort its client reads), give the
        frontends a moment to stream those last messages, then stop them and the worker port."""
        await self._set_health(False)
        self.router.stop_all()
        await asyncio.sleep(0.1)
        await self.frontends.stop(grace)
        await self.hub.stop()
        await self.worker_server.stop(grace)
        shutil.rmtree(self._dir, ignore_errors=True)
