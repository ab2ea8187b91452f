"""control_plane/acceptor.py: a grpc.aio server with several requests for new calls outstanding
accepts a burst of callers in fewer loop turns than grpc.aio's own, serves every method as grpc.aio
does, and stops cleanly with its requests still outstanding."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from control_plane import acceptor

pytestmark = pytest.mark.timeout(120)

CALLS = 64
TURN_SECONDS = 0.002  # each loop turn as long as a frontend's under a streaming load


def test_this_grpcio_has_the_hook() -> None:
    assert acceptor.installed(), f"grpcio {grpc.__version__}: no _make_request_call_future to override"


class Turns:
    """Counts the event loop's turns: one callback a turn, rescheduled each time, that spins for
    `spin` seconds (the stand-in for streaming work)."""

    def __init__(self, spin: float) -> None:
        self.spin, self.count, self.running = spin, 0, True

    def tick(self) -> None:
        self.count += 1
        until = time.perf_counter() + self.spin
        while time.perf_counter() < until:
            pass
        if self.running:
            asyncio.get_running_loop().call_soon(self.tick)


async def _turns_per_call(depth: int) -> float:
    """Loop turns between the first and the last call of a burst of CALLS new calls, per call."""
    turns, seen = Turns(TURN_SECONDS), []

    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"call":
            seen.append(turns.count)
        return b"ok"

    server = acceptor.server(depth=depth)
    handler = grpc.unary_unary_rpc_method_handler(call)
    server.add_registered_method_handlers("burst.Burst", {"Call": handler})  # type: ignore[attr-defined]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    burst = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.control_plane.burst", str(port), str(CALLS), stdout=subprocess.PIPE
    )
    try:
        asyncio.get_running_loop().call_soon(turns.tick)
        out, _ = await asyncio.wait_for(burst.communicate(), 60)
        assert int(out) == CALLS
    finally:
        turns.running = False
        if burst.returncode is None:
            burst.kill()
            await burst.wait()
        await server.stop(None)
    assert len(seen) == CALLS
    return (seen[-1] - seen[0]) / (CALLS - 1)


async def test_a_burst_of_new_calls_takes_fewer_loop_turns_with_more_requests_outstanding() -> None:
    """grpc.aio's own server asks for the next call only after the last reached its task: about six
    turns a call. With eight outstanding it hands over calls already matched: about two."""
    one = await _turns_per_call(1)
    deep = await _turns_per_call(acceptor.ACCEPT_DEPTH)
    depth = acceptor.ACCEPT_DEPTH
    assert deep < 0.6 * one, f"{deep:.1f} turns a call with {depth} outstanding, {one:.1f} with one"


async def test_every_kind_of_method_is_served_and_the_server_stops_cleanly() -> None:
    errors: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: errors.append(context))

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request[::-1]

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            yield str(i).encode()

    server = acceptor.server(depth=4)
    registered = {"Unary": grpc.unary_unary_rpc_method_handler(unary)}
    server.add_registered_method_handlers("t.Registered", registered)  # type: ignore[attr-defined]
    generic = {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Generic", generic),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary_stub = channel.unary_unary("/t.Registered/Unary", None, None)
            stream_stub = channel.unary_stream("/t.Generic/Stream", None, None)
            replies = await asyncio.gather(*(unary_stub(f"call {i}".encode()) for i in range(100)))
            assert replies == [f"call {i}".encode()[::-1] for i in range(100)]

            async def read() -> list[bytes]:
                return [message async for message in stream_stub(b"5")]

            streams = await asyncio.gather(*(read() for _ in range(20)))
            assert streams == [[b"0", b"1", b"2", b"3", b"4"]] * 20
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await channel.unary_unary("/t.Nobody/Home", None, None)(b"")
            assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await asyncio.wait_for(server.stop(None), 30)
    gc.collect()  # a request's error nobody retrieved would be logged as its task is collected
    await asyncio.sleep(0.1)
    assert errors == []
    loop.set_exception_handler(None)


def test_depth_one_is_grpc_aios_own_server() -> None:
    async def make() -> type:
        server = acceptor.server(depth=1)
        kind = type(server._server)  # type: ignore[attr-defined]
        await server.stop(None)
        return kind

    assert asyncio.run(make()).__name__ == "AioServer"
