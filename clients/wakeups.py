"""gRPC asyncio's wake-ups, read in bulk so that completions never queue behind them.

grpc.aio hands every completion of the C core (a message written or read, a call accepted) to the
event loop through a thread that polls the completion queue: for each event the thread queues it
and writes one byte to a socket pair whose other end the loop watches; the loop's callback reads
one byte and runs every queued event. Under load the loop reads fewer bytes than the thread writes
(one a turn), the socket's buffer fills (277 one-byte writes on Linux with default buffers), and
the polling thread blocks in `write`. While it is blocked it neither hands over completions nor
polls the connections (with the C core's default poller it is the thread that reads them), so
events reach the loop at one per turn, and a new call waits behind every one queued ahead of it. A
frontend streaming thousands of messages a second accepted new calls after seconds this way
(docs/performance.md#grpc-wake-ups).

`read_in_bulk(loop)` wraps that callback: each run reads every byte waiting but one, then runs
gRPC's own callback, which reads the last and runs every queued event. The thread queues an event
before it writes its byte, so every byte read stands for an event that this run hands over: none
loses its wake-up, and the socket holds at most the events of one turn.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import socket
import termios
from collections.abc import Callable

# The name of grpc.aio's reader of its wake-up socket (grpcio 1.70-1.85: PollerCompletionQueue).
_GRPC_READER = "_handle_events"


def waiting(sock: socket.socket) -> int:
    """Bytes waiting to be read on `sock` (FIONREAD)."""
    count = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, count, True)
    return count[0]


def read_then_handle(sock: socket.socket, handle_events: Callable[[], None]) -> None:
    """Read all but one of the bytes waiting on `sock`, then run gRPC's reader (which reads one)."""
    left = waiting(sock)
    while left > 1:
        try:
            got = sock.recv(min(left - 1, 65536))
        except BlockingIOError:
            break
        if not got:
            break
        left -= len(got)
    handle_events()


def wake_up_socket(loop: asyncio.AbstractEventLoop) -> socket.socket | None:
    """The socket through which gRPC wakes `loop` (wrapped or not); None when it has none of the
    known shape (no gRPC object bound to this loop yet, another gRPC version, another loop)."""
    selector = getattr(loop, "_selector", None)
    if selector is None:
        return None
    for key in list(selector.get_map().values()):
        reader = key.data[0] if isinstance(key.data, tuple) else None
        callback = getattr(reader, "_callback", None)
        if callback is read_then_handle:
            return key.fileobj if isinstance(key.fileobj, socket.socket) else None
        func = getattr(callback, "func", None)
        if getattr(func, "__name__", "") == _GRPC_READER and isinstance(key.fileobj, socket.socket):
            return key.fileobj
    return None


def read_in_bulk(loop: asyncio.AbstractEventLoop) -> bool:
    """Wrap gRPC's wake-up reader on `loop` (call it once a gRPC server or channel exists in that
    loop; again is harmless). False when there is no reader of the known shape: the loop is left
    as it is."""
    sock = wake_up_socket(loop)
    if sock is None:
        return False
    selector = loop._selector  # type: ignore[attr-defined]
    reader = selector.get_key(sock).data[0]
    if reader._callback is read_then_handle:
        return True
    handle_events = reader._callback
    loop.remove_reader(sock)
    loop.add_reader(sock, read_then_handle, sock, handle_events)
    return True
