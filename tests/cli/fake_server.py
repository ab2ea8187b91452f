"""A stand-in control plane for client tests: canned answers, recorded metadata, no scheduler.

    async with serve_fake(tls=server_cert, api_key="k", refuse_every=3) as fake:
        ... fake.address ...  fake.metadata["Generate"] ...

Generate streams `CANNED_TEXT` as one chunk of `CANNED_TOKENS` tokens, then Finished(STOP).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc
from tests.certs import Issued

CANNED_TEXT = " there"
CANNED_TOKENS = [11, 12, 13]


@dataclass
class FakeState:
    """What the fake saw and how it answers; shared by its services."""

    api_key: str | None = None
    refuse_every: int = 0  # every Nth Generate call answers RESOURCE_EXHAUSTED (0: none)
    calls: int = 0
    metadata: dict[str, list[dict[str, str]]] = field(default_factory=lambda: defaultdict(list))
    address: str = ""
    prompts: list[str] = field(default_factory=list)  # each Generate call's prompt text, in order
    requests: list[gen_pb.GenerateRequest] = field(default_factory=list)  # each Generate call, in order

    async def admit(self, method: str, context: grpc.aio.ServicerContext) -> None:
        """Record the call's metadata; abort UNAUTHENTICATED when a key is required and missing."""
        seen = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        self.metadata[method].append(seen)
        if self.api_key is not None and seen.get("authorization") != f"Bearer {self.api_key}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


class FakeGeneration(gen_grpc.GenerationServicer):
    """Generation with canned answers; method names are gRPC's."""

    def __init__(self, state: FakeState) -> None:
        self.state = state

    async def Generate(
        self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gen_pb.GenerateResponse]:
        await self.state.admit("Generate", context)
        self.state.calls += 1
        self.state.prompts.append(request.text)
        self.state.requests.append(request)
        if self.state.refuse_every and self.state.calls % self.state.refuse_every == 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full")
        rid = request.request_id or f"fake-{self.state.calls}"
        yield gen_pb.GenerateResponse(
            request_id=rid, chunk=gen_pb.TokenChunk(token_ids=CANNED_TOKENS, text=CANNED_TEXT)
        )
        usage = gen_pb.Usage(
            prompt_tokens=len(request.input_ids.ids) or 1, completion_tokens=len(CANNED_TOKENS)
        )
        finished = gen_pb.Finished(
            reason=gen_pb.FINISH_REASON_STOP, usage=usage, timings=gen_pb.Timings(ttft_s=0.001, total_s=0.002)
        )
        yield gen_pb.GenerateResponse(request_id=rid, finished=finished)

    async def Abort(
        self, request: gen_pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.AbortResponse:
        await self.state.admit("Abort", context)
        return gen_pb.AbortResponse(found=False)

    async def GetServerInfo(
        self, request: gen_pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.ServerInfo:
        await self.state.admit("GetServerInfo", context)
        return gen_pb.ServerInfo(model="fake", version="0")


class FakeHealth(health_pb2_grpc.HealthServicer):
    """Always SERVING; records metadata, and checks the key like the other calls."""

    def __init__(self, state: FakeState) -> None:
        self.state = state

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self.state.admit("Check", context)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@contextlib.asynccontextmanager
async def serve_fake(
    tls: Issued | None = None, api_key: str | None = None, refuse_every: int = 0
) -> AsyncIterator[FakeState]:
    """A fake control plane on 127.0.0.1 (ephemeral port; TLS with `tls`), stopped on exit."""
    state = FakeState(api_key=api_key, refuse_every=refuse_every)
    server = grpc.aio.server()
    gen_grpc.add_GenerationServicer_to_server(FakeGeneration(state), server)
    health_pb2_grpc.add_HealthServicer_to_server(FakeHealth(state), server)
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([tls.key_and_chain()]))
    state.address = f"127.0.0.1:{port}"
    await server.start()
    try:
        yield state
    finally:
        await server.stop(None)
