"""The frontend-core link's transport and the client-port guard, on real sockets."""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

import pytest

from control_plane.link import (
    MAX_FRAME_BYTES,
    FrameReader,
    FrameWriter,
    LinkClosed,
    TurnFlush,
    read_frame,
    write_frame,
)
from control_plane.listen import PortGuard
from protos.stepwise.v1 import frontend_pb2 as fe_pb

pytestmark = pytest.mark.timeout(30)


async def _pair(tmp_path: Path) -> tuple[FrameReader[fe_pb.CoreMessage], FrameWriter, asyncio.StreamWriter]:
    accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
        asyncio.get_running_loop().create_future()
    )
    server = await asyncio.start_unix_server(
        lambda r, w: accepted.set_result((r, w)), str(tmp_path / "link.sock")
    )
    async with server:
        _, client_writer = await asyncio.open_unix_connection(str(tmp_path / "link.sock"))
        reader, _ = await accepted
    return FrameReader(reader, fe_pb.CoreMessage), FrameWriter(client_writer), client_writer


async def test_messages_arrive_whole_and_in_order(tmp_path: Path) -> None:
    frames, writer, _ = await _pair(tmp_path)
    for i in range(50):
        writer.write(fe_pb.CoreMessage(token_ids=bytes(range(i % 256)) * 40))
    for i in range(50):
        assert (await frames.read()).token_ids == bytes(range(i % 256)) * 40


async def test_a_closed_peer_is_link_closed(tmp_path: Path) -> None:
    frames, writer, _ = await _pair(tmp_path)
    writer.write(fe_pb.CoreMessage(welcome=fe_pb.CoreWelcome(link_id=3)))
    writer.close()
    assert (await frames.read()).welcome.link_id == 3
    with pytest.raises(LinkClosed):
        await frames.read()


async def test_an_absurd_frame_is_refused_before_it_is_read(tmp_path: Path) -> None:
    frames, _, raw = await _pair(tmp_path)
    raw.write(struct.pack("<I", MAX_FRAME_BYTES + 1))
    with pytest.raises(LinkClosed, match="larger than"):
        await frames.read()


async def test_garbage_is_refused(tmp_path: Path) -> None:
    frames, _, raw = await _pair(tmp_path)
    raw.write(struct.pack("<I", 3) + b"\xff\xff\xff")
    with pytest.raises(LinkClosed, match="unreadable"):
        await frames.read()


async def test_turn_flush_runs_once_per_loop_turn() -> None:
    calls: list[int] = []
    flush = TurnFlush(lambda: calls.append(1))
    for _ in range(10):
        flush.request()
    await asyncio.sleep(0)
    assert calls == [1]
    flush.request()
    await asyncio.sleep(0)
    assert calls == [1, 1]


async def test_turn_flush_keeps_its_minimum_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interval is read on the loop's clock, so the test moves that clock forward by an hour
    instead of waiting: the held-back flush must wait for it and carry both requests."""
    loop = asyncio.get_running_loop()
    hours_passed = 0
    real_time = loop.time
    monkeypatch.setattr(loop, "time", lambda: real_time() + 3600.0 * hours_passed)
    times: list[float] = []
    second = asyncio.Event()

    def flushed() -> None:
        times.append(loop.time())
        if len(times) == 2:
            second.set()

    flush = TurnFlush(flushed, min_interval_s=3600.0)
    flush.request()
    await asyncio.sleep(0)
    assert len(times) == 1
    flush.request()  # within the hour after the first flush: held back until the hour has passed
    flush.request()
    for _ in range(20):  # many loop turns: none of them flushes
        await asyncio.sleep(0)
    assert len(times) == 1
    hours_passed = 1
    await asyncio.wait_for(second.wait(), 10)
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(times) == 2 and times[1] - times[0] >= 3600.0  # the two requests left in one flush


def test_the_guard_keeps_the_port_from_another_control_plane() -> None:
    guard = PortGuard("127.0.0.1", 0)
    frontends: list[socket.socket] = []
    try:
        with pytest.raises(OSError, match="in use"):
            PortGuard("127.0.0.1", guard.port)
        for _ in range(2):  # this control plane's frontends join with SO_REUSEPORT
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(("127.0.0.1", guard.port))
            sock.listen()
            frontends.append(sock)
        guard.release()
        with pytest.raises(OSError, match="in use"):  # the frontends hold it now
            PortGuard("127.0.0.1", guard.port)
    finally:
        guard.release()
        for sock in frontends:
            sock.close()


async def test_abort_ends_the_link_at_once_though_the_peer_reads_nothing(tmp_path: Path) -> None:
    """A stopped peer never takes what is buffered for it: `close` would wait for that before our
    own reader saw the end; `abort` does not wait (how a stalled frontend's link, or a silent
    core's, is ended)."""
    path = str(tmp_path / "link.sock")
    server = await asyncio.start_unix_server(lambda r, w: None, path)  # accepts, never reads
    async with server:
        reader, writer = await asyncio.open_unix_connection(path)
        out = FrameWriter(writer)
        out.write(fe_pb.CoreMessage(token_ids=b"x" * (16 << 20)))  # far more than the socket buffers
        await asyncio.sleep(0.05)
        assert writer.transport.get_write_buffer_size() > 0
        out.abort()
        assert await asyncio.wait_for(reader.read(), 2) == b""


def test_blocking_frames_arrive_whole_and_eof_is_link_closed() -> None:
    left, right = socket.socketpair()
    with left, right:
        for i in range(5):
            write_frame(left, fe_pb.FrontendMessage(pong=fe_pb.Pong(seq=i, loop_silent_s=i / 2)))
        got = [read_frame(right, fe_pb.FrontendMessage).pong for _ in range(5)]
        assert [(p.seq, p.loop_silent_s) for p in got] == [(i, i / 2) for i in range(5)]
        left.sendall(struct.pack("<I", 10) + b"abc")  # a frame cut short
        left.shutdown(socket.SHUT_WR)
        with pytest.raises(LinkClosed, match="EOF"):
            read_frame(right, fe_pb.FrontendMessage)
