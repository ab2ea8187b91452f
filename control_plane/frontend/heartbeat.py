"""A frontend's end of the heartbeat (frontend.proto): a thread that answers the core's pings.

The answer is given by a thread on a connection of its own, not by the event loop on the link: on the
link it would queue behind token batches not yet read, and on the loop behind a burst of streaming
work; either could get a busy frontend killed. A thread is held up only by what holds the GIL (a GC
pause: well under the timeout). So that a wedged loop in a live process is found too, each answer
says how long ago the loop last ran (it looks in once per interval); the core judges
(core/heartbeat.py).

The same thread notices a core that stops pinging: a stopped core closes no socket, so its silence is
the only sign. It then tells the loop, which ends every call as if the link had closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable

import structlog

from control_plane.link import LinkClosed, read_frame, write_frame
from protos.stepwise.v1 import frontend_pb2 as fe_pb

log = structlog.get_logger("stepwise.frontend")


class Heartbeat:
    """Answers pings on the heartbeat connection; calls `on_silent(reason)` on the event loop when the
    core stops pinging (or the connection fails)."""

    def __init__(
        self,
        path: str,
        hello: fe_pb.FrontendHello,
        interval_s: float,
        timeout_s: float,
        on_silent: Callable[[str], None],
    ) -> None:
        self.path = path
        self.hello = hello
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_silent = on_silent
        self._loop: asyncio.AbstractEventLoop | None = None
        # When the event loop last ran its look-in (time.monotonic(); read by the thread).
        self._loop_seen = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._look_in()
        self._thread = threading.Thread(target=self._run, name="stepwise-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's recv

    @property
    def loop_silent_s(self) -> float:
        return max(0.0, time.monotonic() - self._loop_seen)

    def _look_in(self) -> None:
        assert self._loop is not None
        self._loop_seen = time.monotonic()
        self._timer = self._loop.call_later(self.interval_s, self._look_in)

    def _run(self) -> None:
        try:
            reason = self._answer()
        except Exception as exc:
            reason = f"the heartbeat failed: {exc!r}"
        if self._stopped or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending anyway
            self._loop.call_soon_threadsafe(self.on_silent, reason)

    def _answer(self) -> str:
        """Answer every ping until the core falls silent; why it counts as silent."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            self._sock = sock
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
                write_frame(sock, fe_pb.FrontendMessage(hello=self.hello))
                while True:
                    message = read_frame(sock, fe_pb.CoreMessage)
                    if message.HasField("ping"):
                        pong = fe_pb.Pong(seq=message.ping.seq, loop_silent_s=self.loop_silent_s)
                        write_frame(sock, fe_pb.FrontendMessage(pong=pong))
            except TimeoutError:
                return f"the core sent no heartbeat for {self.timeout_s:g} s"
            except (LinkClosed, OSError) as exc:
                return f"the core's heartbeat connection failed: {exc}"
