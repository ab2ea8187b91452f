"""gRPC statuses as HTTP statuses: gRPC's own refusal of a request too large is not a 429."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from gateway.errors import from_grpc
from protos.stepwise.v1 import generation_pb2 as gen_pb
from tests.gateway.fake import Call, FakeControlPlane, app_with, http_client

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def tiny_server() -> AsyncIterator[str]:
    """A gRPC server with small message and metadata limits, answering any call with its request."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 1000),
            ("grpc.max_metadata_size", 1000),
            ("grpc.absolute_max_metadata_size", 1000),
        ]
    )
    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", {"Echo": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def _refusal(
    address: str, body: bytes, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary("/t.Echo/Echo")(body, metadata=metadata, timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return refused.value


async def test_a_message_over_the_servers_limit_is_413(tiny_server: str) -> None:
    error = from_grpc(await _refusal(tiny_server, b"x" * 5000))
    assert error.status == 413 and error.body()["error"]["type"] == "invalid_request_error"


async def test_metadata_over_the_servers_limit_is_431(tiny_server: str) -> None:
    error = from_grpc(await _refusal(tiny_server, b"x", (("authorization", "Bearer " + "k" * 5000),)))
    assert error.status == 431 and error.body()["error"]["type"] == "invalid_request_error"


def test_a_full_queue_is_still_429() -> None:
    full = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        "The request queue is full.",
    )
    assert from_grpc(full).status == 429


class _Refusing(FakeControlPlane):
    """Refuses every call with RESOURCE_EXHAUSTED and these trailers (a control plane's quota)."""

    def __init__(self, details: str, trailers: tuple[tuple[str, str], ...]) -> None:
        super().__init__()
        self.details, self.trailers = details, trailers

    def stream(self, request: gen_pb.GenerateRequest, *, api_key: str | None = None) -> Call:
        self.requests.append(request)
        error = grpc.aio.AioRpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(*self.trailers),
            self.details,
        )
        return Call([], error)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
        ("/v1/completions", {"prompt": ["hi", "ho"], "max_tokens": 2, "n": 2}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
    ],
)
async def test_over_a_quota_is_429_with_retry_after_and_an_objective_without(
    path: str, body: dict[str, object]
) -> None:
    """Every generating endpoint, streamed or not, one prompt or several: a tenant's quota refusal
    carries the control plane's retry-after as Retry-After; an unmeetable objective (no trailer)
    is 429 too, with no Retry-After (waiting says nothing about when it could be met)."""
    quota = _Refusing("token_rate: tenant 't' used its token rate; retry in 7 s", (("retry-after", "7"),))
    async with http_client(app_with(quota)) as http:
        reply = await http.post(path, json=body)
    assert reply.status_code == 429, reply.text
    assert reply.headers["retry-after"] == "7"
    assert reply.json()["error"]["type"] == "rate_limit_error"
    slo = _Refusing("ttft_slo_ms: the predicted time to first token exceeds the objective", ())
    async with http_client(app_with(slo)) as http:
        reply = await http.post(path, json=body)
    assert reply.status_code == 429 and "retry-after" not in reply.headers, reply.headers
    assert reply.json()["error"]["message"].startswith("ttft_slo_ms: ")
