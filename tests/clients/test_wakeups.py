"""gRPC's wake-ups read in bulk (clients/wakeups.py): the polling thread never blocks on a full
socket, however many completions a turn brings, and every completion still reaches the loop."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from clients import wakeups

pytestmark = pytest.mark.timeout(120)

STREAMS = 32  # 4 connections x 8 calls from the flood process
MESSAGES = 2_000


def test_all_waiting_bytes_but_one_are_read_before_grpcs_reader_runs() -> None:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    runs: list[int] = []

    def handle_events() -> None:  # gRPC's reader: one byte, then every queued event
        runs.append(len(ours.recv(1)))

    with ours, theirs:
        theirs.sendall(b"1" * 500)
        time.sleep(0.05)
        assert wakeups.waiting(ours) == 500
        wakeups.read_then_handle(ours, handle_events)
        assert runs == [1] and wakeups.waiting(ours) == 0
        theirs.sendall(b"1")
        time.sleep(0.05)
        wakeups.read_then_handle(ours, handle_events)  # one byte: left for gRPC's reader
        assert runs == [1, 1] and wakeups.waiting(ours) == 0


def _handlers(written: list[int]) -> grpc.GenericRpcHandler:
    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for _ in range(MESSAGES):
            written[0] += 1
            busy_until = time.perf_counter() + 30e-6  # some work per message, as a frontend does
            while time.perf_counter() < busy_until:
                pass
            yield b"12345678"

    async def count(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return str(written[0]).encode()

    return grpc.method_handlers_generic_handler(
        "flood.Flood",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Count": grpc.unary_unary_rpc_method_handler(count),
        },
    )


def test_a_loop_without_grpc_is_left_as_it_is() -> None:
    loop = asyncio.new_event_loop()
    try:
        assert wakeups.wake_up_socket(loop) is None
        assert not wakeups.read_in_bulk(loop)
    finally:
        loop.close()


async def test_under_a_flood_of_completions_the_wake_up_socket_never_fills_and_calls_are_answered() -> None:
    """Without the wrapper the socket holds its capacity (277 bytes here) all the while: the polling
    thread is blocked in write. With it, at most the events of a turn wait: a few per stream."""
    written = [0]
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handlers(written),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.get_running_loop()
    assert wakeups.read_in_bulk(loop), f"grpcio {grpc.__version__}: no wake-up reader of the known shape"
    assert wakeups.read_in_bulk(loop)  # again: already wrapped
    sock = wakeups.wake_up_socket(loop)
    assert sock is not None
    flood = subprocess.Popen([sys.executable, "-m", "tests.clients.flood", str(port), "4", "8"])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            count = channel.unary_unary("/flood.Flood/Count", None, None)
            deadline = time.monotonic() + 60
            while written[0] < 20 * STREAMS:  # every stream flowing
                assert flood.poll() is None and time.monotonic() < deadline, "the flood did not start"
                await asyncio.sleep(0.05)
            most = 0
            for _ in range(200):
                most = max(most, wakeups.waiting(sock))
                await asyncio.sleep(0.005)
            before = written[0]
            answered = int(await asyncio.wait_for(count(b""), 30))
            assert answered >= before
        assert flood.poll() is None, "the flood client died"
        assert most <= 4 * STREAMS, f"{most} wake-up bytes waited: gRPC's polling thread was blocked"
    finally:
        flood.kill()
        flood.wait(10)
        await server.stop(0)
