"""The control plane's core process: the worker dial-in service (one engine per attached worker),
the hub its frontends link to, and the frontend processes themselves (docs/architecture.md#processes).

Clients reach the frontends on the client port; workers dial the core's worker port. Both ports carry
standard health checking and server reflection. Health ("" on either port) is NOT_SERVING until a
worker is attached, again whenever none is (or every one is leaving), and while the control plane
drains: then it cannot take new work. The worker port's "liveness" is SERVING from start to stop,
workers or not, for liveness and startup probes.

Many control planes may serve one fleet of workers: each answers Census on its worker port (how
many workers it holds, and whether it would take the worker asked about; census.py), and with
`--peers` it compares itself with the others and asks a worker to move when it holds too many
(rebalance.py). On SIGTERM it drains (`ControlPlane.drain`):
no new work, running streams finish within `--drain-timeout`, every worker is told to move.

Trust: clients may be asked for a bearer token (`--api-key`) and served over TLS (frontend/generation.py);
workers may be required to present a certificate from `--worker-ca` (mutual TLS). Nothing a peer
sends is believed before it is checked: requests by the frontends (frontend/client_codec.py; the core
reads the checked value they send, control_plane/link_params.py), hellos and results in worker_checks.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from clients.wakeups import read_in_bulk
from control_plane import metrics
from control_plane.config import ControlConfig
from control_plane.core.census import PeerCensus
from control_plane.core.drain import Departure
from control_plane.core.engine import Engine
from control_plane.core.fleet import Fleet, Router
from control_plane.core.fleet.census import take as take_census
from control_plane.core.grammar_gate import GrammarGate
from control_plane.core.hub import FrontendHub
from control_plane.core.rebalance import Rebalancer
from control_plane.core.server_info import server_info, tenant_infos
from control_plane.core.supervisor import FrontendEntry, Frontends
from control_plane.core.worker_checks import hello_refusal
from control_plane.core.worker_link import StreamChannel
from control_plane.listen import bind, server_credentials
from control_plane.reflection import enable_reflection
from control_plane.tenants import table as tenant_table
from control_plane.tenants.book import TenantBook
from control_plane.tenants.metrics import TenantMetrics
from control_plane.tokenizer import Tokenizer
from protos import worker_codec
from protos.stepwise.v1 import reports_pb2 as reports_pb
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.stepwise.v1 import worker_pb2_grpc as wk_grpc
from protos.worker import PROTOCOL_VERSION, Census, Welcome

log = structlog.get_logger("stepwise.server")

VERSION = "0.1.0"
WORKER_SERVICE = wk_pb.DESCRIPTOR.services_by_name["WorkerLink"].full_name
# The worker port's health name for liveness and startup probes: SERVING while the process runs.
LIVENESS = "liveness"
DRAINING_REFUSAL = "the control plane is draining; attach to another control plane"
MOVE_ON_DRAIN = "the control plane is draining"
# After the drain timeout, how long the aborted streams' finishes, and then the workers' moves,
# may take before the control plane stops anyway.
ABORT_GRACE_S = 2.0
# A call held for its grammar waits at most this many --grammar-compile-timeout: the worker
# compiles what the frontend compiled within one, a few at a time.
GRAMMAR_DEADLINE_FACTOR = 3.0
MOVE_GRACE_S = 5.0
POLL_S = 0.02
# SO_REUSEPORT off: a second control plane on the same port fails to start. Streams wait in the
# server rather than being cancelled.
WORKER_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.server_max_unrequested_time_in_server", 3600),
    # Workers ping every 20 s (data_plane/dialer.py), also while idle: accept that, never GOAWAY.
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]


class WorkerLinkService(wk_grpc.WorkerLinkServicer):
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.config = plane.config
        self.tokenizer = plane.tokenizer
        self.router = plane.router
        self.hub = plane.hub

    async def Census(
        self, request: wk_pb.CensusRequest, context: grpc.aio.ServicerContext
    ) -> wk_pb.CensusReply:
        """The counts; asked about a hello, also whether Connect would refuse it for good (the same
        check, so that a worker, or a peer thinking of moving one here, need not try to find out)."""
        census = self.plane.census()
        hello = worker_codec.census_hello(request)
        if hello is not None:
            census = dataclasses.replace(census, hello_judged=True, refusal=self._final_refusal(hello))
        return worker_codec.census_to_proto(census)

    async def Connect(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("msg") != "hello":  # type: ignore[attr-defined]
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the first message must be a hello")
            return
        limits = worker_codec.hello_from_proto(first.hello)
        refusal = self._final_refusal(first.hello)
        if refusal:
            log.error("worker refused", worker=limits.worker_id, reason=refusal)
            await context.write(worker_codec.control_to_proto(Welcome(False, refusal)))
            return
        retry = self._passing_refusal(first.hello)
        if retry:
            log.warning("worker refused for now", worker=limits.worker_id, reason=retry)
            await context.write(worker_codec.control_to_proto(Welcome(False, retry, retryable=True)))
            return
        channel = StreamChannel(context)
        engine = Engine(
            self.config,
            limits,
            channel,
            self.hub,
            self.plane.fleet,
        )
        channel.on_drain = engine.worker_draining
        channel.on_received = engine.worker_received
        gate = GrammarGate(
            limits.worker_id,
            engine.submit,
            lambda arrival, verdict, message: self.hub.verdict(arrival.samples[0].uid, verdict, message),
            channel.prepare,
            limits.prepares_grammars,
            GRAMMAR_DEADLINE_FACTOR * self.config.grammar_compile_timeout_s,
        )
        channel.on_grammar_ready = gate.ready
        engine.grammar_gate = gate
        self.hub.grammar_gates[engine] = gate
        # Attached before the welcome: a call that follows the welcome at once finds the worker.
        self.router.attach(engine)
        try:
            await context.write(worker_codec.control_to_proto(Welcome(True, transfer_reports=True)))
        except BaseException:
            engine.abandon("the welcome could not be sent")
            self.router.detach(engine)
            raise
        channel.start()
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
            self.hub.grammar_gates.pop(engine, None)
            gate.close()
            self.router.detach(engine)
            log.info("worker detached", worker=limits.worker_id)
        if engine.fault is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"dropped: {engine.fault}")

    def _final_refusal(self, hello: wk_pb.Hello) -> str:
        """Why a worker with this hello is refused for good ("" when it is not)."""
        limits = worker_codec.hello_from_proto(hello)
        return self._refusal(hello) or hello_refusal(limits, self.config.limits, self.tokenizer.vocab_size)

    def _refusal(self, hello: wk_pb.Hello) -> str:
        want = PROTOCOL_VERSION
        if hello.protocol_version != want:
            return f"protocol_version {hello.protocol_version} is not supported (want {want})"
        page = self.config.scheduler.page_size
        if page is not None and hello.page_size != page:
            return f"page_size {hello.page_size} differs from the control plane's --page-size {page}"
        chunk = self.config.scheduler.chunked_prefill_size
        if page is None and chunk and hello.page_size > 0 and chunk % hello.page_size:
            # SGLang asserts the chunk is a whole number of pages (docs/scheduler.md#chunked-prefill); the
            # page is the worker's here.
            return f"page_size {hello.page_size} does not divide --chunked-prefill-size {chunk}"
        fingerprint = self.router.model_fingerprint
        if fingerprint and hello.model_fingerprint != fingerprint:
            return "model_fingerprint differs from the workers already attached"
        return ""

    def _passing_refusal(self, hello: wk_pb.Hello) -> str:
        """A refusal that may pass later (Welcome.retryable): the worker may try again, here or at
        another control plane."""
        if self.plane.draining:
            return DRAINING_REFUSAL
        if self.router.has(hello.worker_id):
            # Its previous session (a redial after a broken link) has not ended here yet.
            return f"worker_id {hello.worker_id!r} is already attached"
        return ""


class ControlPlane:
    """The core and its frontends; `start()` binds both ports, `drain()` winds down as on SIGTERM,
    `stop()` ends everything at once."""

    def __init__(
        self, config: ControlConfig, log_level: str = "info", frontend_entry: FrontendEntry | None = None
    ) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.router: Router[Engine] = Router(
            model_name=config.model_name or config.model_dir.name,
            on_change=self._on_workers_changed,
            routing=config.routing,
        )
        self.fleet: Fleet[Engine] = Fleet(self.router, on_leaving=self.worker_leaving)
        self.worker_server = grpc.aio.server(options=WORKER_SERVER_OPTIONS)
        self._dir = tempfile.mkdtemp(prefix="stepwise-core-")
        self.frontends = Frontends(config, str(Path(self._dir) / "link.sock"), log_level, frontend_entry)
        self.hub = FrontendHub(config, self.router, self.server_info, on_stalled=self.frontends.kill)
        if config.tenants_file is not None:
            table = tenant_table.load(config.tenants_file)
            self.hub.tenants = TenantBook.of(table, TenantMetrics())
        self.port = 0
        self.worker_port = 0
        # Random per process: peers (and this control plane, in its own --peers) recognise it by it.
        self.id = uuid.uuid4().hex
        self.draining = False
        self.rebalancer: Rebalancer | None = None
        self._rebalancing: asyncio.Task[None] | None = None

    def server_info(self) -> reports_pb.ServerInfo:
        info = server_info(self.router, self.tokenizer, VERSION, model_path=str(self.config.model_dir))
        if self.hub.tenants is not None:
            info.tenants.extend(tenant_infos(self.hub.tenants))
        return info

    def reload_tenants(self) -> bool:
        """Reread --tenants (on SIGHUP): a file that does not check out leaves the table as it was."""
        path, book = self.config.tenants_file, self.hub.tenants
        if path is None or book is None:
            log.warning("SIGHUP: no --tenants file to reload")
            return False
        try:
            table = tenant_table.load(path)
            tenant_table.check_objectives(table, self.config.scheduler.slo_cost)
        except tenant_table.TenantFileError as exc:
            log.error("tenant file not reloaded: the previous table stays", error=str(exc))
            return False
        book.reload(table)
        self.config.scheduler.retenant(table.weights(), table.slo_defaults())
        log.info("tenant file reloaded", path=str(path), tenants=len(table.tenants))
        return True

    def census(self) -> Census:
        """What this control plane answers to Census: its workers (not leaving) and their load."""
        return take_census(
            self.id, self.router.engines.values(), not self.draining, self.router.model_fingerprint
        )

    async def start(self) -> None:
        await self.hub.start(self.frontends.link_path)
        wk_grpc.add_WorkerLinkServicer_to_server(WorkerLinkService(self), self.worker_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.worker_server)
        enable_reflection((WORKER_SERVICE, health.SERVICE_NAME), self.worker_server)
        _, worker_creds = server_credentials(self.config.security)
        self.worker_port = bind(self.worker_server, self.config.host, self.config.worker_port, worker_creds)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self._set_health(False)
        await self.worker_server.start()
        if not read_in_bulk(asyncio.get_running_loop()):
            log.warning("gRPC's wake-up socket not found: its completions reach the loop one a turn")
        self.port = await self.frontends.start(self.hub.connected)
        metrics.serve(self.config.metrics_port, self.config.host)
        self._start_rebalancing()
        log.info(
            "control plane listening",
            port=self.port,
            worker_port=self.worker_port,
            frontends=self.config.frontends,
            model=str(self.config.model_dir),
            client_tls=self.config.security.client_tls,
            worker_mtls=self.config.security.worker_ca is not None,
            api_keys=len(self.config.security.api_keys),
            control_plane_id=self.id,
            peers=self.config.peers or None,
        )

    def _start_rebalancing(self) -> None:
        if not self.config.peers:
            return
        peers = PeerCensus(self.config.peers, self.config.security)
        self.rebalancer = Rebalancer(self.config.rebalance_interval_s, peers, self.census, self.router)
        self._rebalancing = asyncio.get_running_loop().create_task(self.rebalancer.run())

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", WORKER_SERVICE):
            await self.health.set(name, status)

    def _serving(self) -> bool:
        return not self.draining and bool(self.router.available())

    def _on_workers_changed(self, count: int) -> None:
        self.hub.broadcast_state()
        asyncio.get_running_loop().create_task(self._set_health(self._serving()))

    def worker_leaving(self, engine: Engine) -> None:
        """An engine started to drain or move: it no longer counts as a worker that can serve."""
        self._on_workers_changed(len(self.router.available()))

    async def drain(self) -> None:
        """Wind down as on SIGTERM. At once: health NOT_SERVING, new Generate calls and new workers
        refused (both may retry elsewhere), Census accepting=false. Running streams may finish
        within --drain-timeout; those still running then end with an abort that says so. Then
        every worker is told to move, and the caller stops the control plane."""
        if self.draining:
            return
        started = time.monotonic()
        self.draining = self.hub.draining = True
        await self._set_health(False)
        self.hub.broadcast_state()
        timeout = self.config.drain_timeout_s
        log.info(
            "control plane draining", workers=len(self.router.engines), live=self._live(), timeout_s=timeout
        )
        aborted = 0
        if not await _until(lambda: self._live() == 0, timeout):
            message = (
                f"control plane drained: the request was still running after its --drain-timeout of "
                f"{timeout:g} s; retry on another control plane"
            )
            aborted = sum(e.abort_everything(message) for e in self.router.engines.values())
            await _until(lambda: self._live() == 0, ABORT_GRACE_S)
        workers = list(self.router.engines.values())
        for engine in workers:
            engine.leave(Departure.MOVE, MOVE_ON_DRAIN)
        await _until(lambda: not self.router.engines, MOVE_GRACE_S)
        seconds = round(time.monotonic() - started, 3)
        log.info("control plane drained", aborted=aborted, moved=len(workers), seconds=seconds)

    def _live(self) -> int:
        """Samples live on any worker (arrivals the schedulers have not seen yet included)."""
        return sum(len(e.streams) for e in self.router.engines.values())

    async def stop(self, grace: float = 2.0) -> None:
        """Stop the engines (every live request ends with an abort its client reads), give the
        frontends a moment to stream those last messages, then stop them and the worker port."""
        if self._rebalancing is not None:
            self._rebalancing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._rebalancing
        await self._set_health(False)
        self.router.stop_all()
        await asyncio.sleep(0.1)
        await self.frontends.stop(grace)
        await self.hub.stop()
        await self.worker_server.stop(grace)
        shutil.rmtree(self._dir, ignore_errors=True)


async def _until(done: Callable[[], bool], timeout: float) -> bool:
    """Wait until `done()` holds (looked at every POLL_S), at most `timeout` seconds: whether it does."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True
