"""A frontend process: its gRPC server on the shared client port (with health and reflection) and
its link to the core, started by the supervisor, until SIGTERM or until the core goes away."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from clients.wakeups import read_in_bulk
from control_plane import acceptor
from control_plane.config import ControlConfig, Limits
from control_plane.frontend.core_link import CoreState, Frontend
from control_plane.frontend.generation import GENERATION_SERVICE, GenerationService, generation_handlers
from control_plane.listen import bind, server_credentials
from control_plane.reflection import enable_reflection
from control_plane.tokenizer import Tokenizer

log = structlog.get_logger("stepwise.frontend")


# gRPC's own limit on a received message. Prompts sent as input_ids are bounded by the model's context,
# not by --max-prompt-bytes: they keep at least this much room, as before the limit followed the flag.
GRPC_DEFAULT_MESSAGE_BYTES = 4 * 1024 * 1024
# The largest value a gRPC integer option takes.
_GRPC_INT_MAX = (1 << 31) - 1
# A call's metadata, soft and hard limit alike. gRPC's own (8 KiB soft, 16 KiB hard, refused at random
# between the two) answer an over-long header with RESOURCE_EXHAUSTED, which reads as "retry later":
# within this limit an unknown bearer key of any length reaches the service and is UNAUTHENTICATED.
# Past it gRPC's RESOURCE_EXHAUSTED remains (`received metadata size exceeds ...`; the gateway answers
# it with 431), and it bounds what one call's headers may hold.
MAX_METADATA_BYTES = 256 * 1024


def max_request_bytes(limits: Limits) -> int:
    """The client port's limit on a request message: twice the largest allowed request (the prompt at
    --max-prompt-bytes, every other field at its own limit). A request up to twice too large reaches
    the service, which refuses it with INVALID_ARGUMENT naming the field and the flag; past that
    gRPC refuses it with RESOURCE_EXHAUSTED (`Received message larger than max`; the gateway answers
    it with 413), and the limit bounds the memory one call's message may take."""
    prompt = max(limits.max_prompt_bytes, GRPC_DEFAULT_MESSAGE_BYTES)
    # UTF-8 takes at most 4 bytes a character; a repeated field's tag and length at most 6 bytes an
    # element; a negative int32 varint 10 bytes; 1 KiB covers every scalar field.
    stops = 4 * limits.max_stop_chars + 6 * limits.max_stop_strings + 10 * limits.max_stop_token_ids
    stops += 10 * limits.max_top_logprobs  # token_ids_logprob
    ids = 2 * (4 * limits.max_id_chars + 6)
    return min(2 * (prompt + stops + ids + 1024), _GRPC_INT_MAX)


def server_options(reuse_port: bool, limits: Limits) -> list[tuple[str, int]]:
    """Options for a client-facing gRPC server sized for many concurrent streams.

    gRPC cancels calls that wait unrequested longer than `server_max_unrequested_time_in_server`
    (30 s by default) and rejects calls beyond its pending-request limits (1000 soft, 3000 hard):
    past ~2,000 concurrent streams clients saw CANCELLED. Calls wait instead; Generate calls beyond
    --max-concurrent-streams get RESOURCE_EXHAUSTED from the service itself (generation.py), not from
    grpc.aio's maximum_concurrent_rpcs, which would refuse health probes and GetServerInfo too.
    """
    return [
        ("grpc.max_receive_message_length", max_request_bytes(limits)),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.so_reuseport", int(reuse_port)),
        ("grpc.server_max_unrequested_time_in_server", 3600),
        ("grpc.server.max_pending_requests", 1 << 20),
        ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
    ]


class FrontendServer:
    """One frontend: the link to the core and a gRPC server on the client port with health and
    reflection. Health is SERVING while the core has a worker attached and does not drain."""

    def __init__(self, config: ControlConfig, index: int, reuse_port: bool = True) -> None:
        self.config = config
        tokenizer = Tokenizer.from_dir(config.model_dir)
        # The detokenizer's byte table now, not in the first call (~0.1 s for a 49k vocabulary).
        tokenizer.token_bytes()
        self.frontend = Frontend(config, tokenizer, index)
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.server = acceptor.server(server_options(reuse_port, config.limits))
        self.port = 0

    async def start(self, link_path: str, port: int) -> int:
        """Listen on `port` (the core holds it until every frontend listens; see listen.py), then dial
        the core. Until the core's state arrives, health says NOT_SERVING and calls are refused."""
        handlers = generation_handlers(GenerationService(self.frontend))
        # Registered, not generic: each method gets its own accept (grpcio's stubs lack the method).
        self.server.add_registered_method_handlers(GENERATION_SERVICE, handlers)  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection((GENERATION_SERVICE, health.SERVICE_NAME), self.server)
        client_creds, _ = server_credentials(self.config.security)
        self.port = bind(self.server, self.config.host, port, client_creds, probe=False)
        await self._set_health(False)
        await self.server.start()
        if not read_in_bulk(asyncio.get_running_loop()):
            log.warning("gRPC's wake-up socket not found: its completions reach the loop one a turn")
        self.frontend.on_state.append(self._on_state)
        await self.frontend.connect(link_path)
        await self._set_health(self.frontend.state.serving)
        return self.port

    def _on_state(self, state: CoreState) -> None:
        asyncio.get_running_loop().create_task(self._set_health(state.serving))

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
    # What start-up made (modules, protobuf descriptors, the tokenizer, the gRPC server) lives as long
    # as the process: frozen, the collector stops walking it on every collection of the streaming path.
    gc.collect()
    gc.freeze()
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
