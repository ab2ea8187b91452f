"""The frontend-core link's transport: length-framed protobuf messages over a Unix-domain socket.

Measured against pyzmq (bench/bench_ipc.py): asyncio's own Unix streams cost about half the CPU per
message on both ends and half the round-trip latency of zmq.asyncio DEALER/ROUTER, and a broken
connection is an immediate EOF, which is how the core learns that a frontend died (zmq hides peer
loss). Each direction sends at most one message per event-loop turn: whatever a turn produced is
merged into it by the sender's outbox (frontend/core_link.py, core/hub.py), so the message rate is the step
rate, not the token rate.

A stopped or wedged peer closes nothing, so EOF alone does not find it: a heartbeat on a second
connection does (frontend.proto; core/heartbeat.py, frontend/heartbeat.py). The frontend's end of it is
a thread with a blocking socket, hence the blocking `read_frame` and `write_frame` below.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError, Message

# A frame larger than this is a broken peer, not a message.
MAX_FRAME_BYTES = 256 * 1024 * 1024
# A peer whose unread output reaches this much is not keeping up: it is disconnected rather than
# letting the sender's memory grow without bound.
MAX_BUFFERED_BYTES = 512 * 1024 * 1024
_HEADER = struct.Struct("<I")

# A uid (a frontend's stream key) carries the frontend's link id above these bits (frontend.proto).
UID_LINK_SHIFT = 40


def link_of(uid: int) -> int:
    """The frontend link a uid belongs to."""
    return uid >> UID_LINK_SHIFT


# What a client is told while its control plane drains (by the frontend itself, or by the core).
DRAINING = "the control plane is draining (shutting down); retry on another control plane"

M = TypeVar("M", bound=Message)


class LinkClosed(Exception):
    """The peer closed the link, broke it, or sent something that is not a frame of the protocol."""


class FrameReader(Generic[M]):
    """Reads whole messages of one type; LinkClosed at EOF or on a malformed frame."""

    def __init__(self, reader: asyncio.StreamReader, message_type: type[M]) -> None:
        self._reader = reader
        self._type = message_type

    async def read(self) -> M:
        try:
            (size,) = _HEADER.unpack(await self._reader.readexactly(_HEADER.size))
            if size > MAX_FRAME_BYTES:
                raise LinkClosed(f"frame of {size} bytes is larger than {MAX_FRAME_BYTES}")
            body = await self._reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise LinkClosed(f"link closed: {exc!r}") from None
        message = self._type()
        try:
            message.ParseFromString(body)
        except DecodeError as exc:
            raise LinkClosed(f"unreadable {self._type.__name__}: {exc}") from None
        return message


class FrameWriter:
    """Writes whole messages without waiting: the transport buffers, bounded by MAX_BUFFERED_BYTES."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    def write(self, message: Message) -> None:
        if self._writer.is_closing():
            raise LinkClosed("link is closed")
        if self._writer.transport.get_write_buffer_size() > MAX_BUFFERED_BYTES:
            self._writer.close()
            raise LinkClosed(f"peer fell behind by more than {MAX_BUFFERED_BYTES} bytes")
        body = message.SerializeToString()
        self._writer.write(_HEADER.pack(len(body)) + body)

    def close(self) -> None:
        self._writer.close()

    def abort(self) -> None:
        """Close at once, dropping what is buffered: a peer that stopped reading never takes it, and
        `close` would wait for that before the link counts as closed."""
        self._writer.transport.abort()


def read_frame(sock: socket.socket, message_type: type[M]) -> M:
    """One whole message from a blocking socket; LinkClosed at EOF or on a malformed frame
    (TimeoutError, or OSError, as the socket raises them)."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise LinkClosed(f"frame of {size} bytes is larger than {MAX_FRAME_BYTES}")
    message = message_type()
    try:
        message.ParseFromString(_recv_exactly(sock, size))
    except DecodeError as exc:
        raise LinkClosed(f"unreadable {message_type.__name__}: {exc}") from None
    return message


def write_frame(sock: socket.socket, message: Message) -> None:
    body = message.SerializeToString()
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise LinkClosed("link closed: EOF")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


class TurnFlush:
    """Calls `flush` once at the end of the current event-loop turn, however often it is asked to;
    with `min_interval_s`, also no sooner than that after the previous flush (what accrues meanwhile
    leaves together)."""

    def __init__(self, flush: Callable[[], None], min_interval_s: float = 0.0) -> None:
        self._flush = flush
        self._min_interval_s = min_interval_s
        self._scheduled = False
        self._last = float("-inf")

    def request(self) -> None:
        if self._scheduled:
            return
        self._scheduled = True
        loop = asyncio.get_running_loop()
        wait = self._last + self._min_interval_s - loop.time()
        if wait > 0:
            loop.call_later(wait, self._run)
        else:
            loop.call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        self._last = asyncio.get_running_loop().time()
        self._flush()
