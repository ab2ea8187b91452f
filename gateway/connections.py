"""uvicorn's h11 protocol with what uvicorn lacks: a deadline for each request's head, and a limit
on open connections answered with a clean 503; and accept errors logged once per interval.

uvicorn times out only idle keep-alive connections (after a response; `timeout_keep_alive`), so a
connection that opens and sends half a request head, or a byte a minute, is held forever: enough of
them and `accept()` fails for want of file descriptors. Its `limit_concurrency` does not help: it
answers 503 only once a request head has arrived, so the connections it counts keep their files,
and its answer is plain text. The limit here is checked as a connection is made, and the 503 is
OpenAI's error shape with `Retry-After`, which OpenAI's clients honour.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any, ClassVar, cast

import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import GatewayError
from gateway.limits import HttpLimits

log = structlog.get_logger("stepwise.gateway")

LOG_INTERVAL_S = 10.0
# The message asyncio's selector loop reports a failed accept() with (EMFILE, ENFILE, ENOBUFS,
# ENOMEM), once per attempt: CPython 3.11 keeps trying up to the listen backlog each time.
ACCEPT_OUT_OF_RESOURCES = "socket.accept() out of system resource"
ACCEPT_FAILED_EVENT = "accept() failed; raise ulimit -n or lower --max-connections"


class Throttled:
    """A warning logged at most once per interval, with how many times it happened since."""

    def __init__(
        self, event: str, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ):
        self.event, self.interval_s, self.clock = event, interval_s, clock
        self.count = 0
        self.logged_at = -float("inf")

    def warn(self, **fields: object) -> None:
        self.count += 1
        now = self.clock()
        if now - self.logged_at >= self.interval_s:
            log.warning(self.event, times=self.count, interval_s=self.interval_s, **fields)
            self.count, self.logged_at = 0, now


class AcceptErrorLog:
    """The event loop's exception handler: failed accepts once per interval, the rest as asyncio
    would log them."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.accept_failed = Throttled(ACCEPT_FAILED_EVENT, interval_s)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_OUT_OF_RESOURCES:
            loop.default_exception_handler(context)
            return
        self.accept_failed.warn(error=str(context.get("exception")))


def protocol_class(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn builds each connection with (`uvicorn.Config(http=...)`), which
    it calls with uvicorn's own arguments only: the limits ride on the class."""
    attributes = {"limits": limits, "busy": Throttled(BUSY_EVENT), "busy_answer": busy_response(limits)}
    return cast(type[GuardedH11Protocol], type("GuardedH11Protocol", (GuardedH11Protocol,), attributes))


BUSY_EVENT = "connections refused with 503: --max-connections are open"


class GuardedH11Protocol(H11Protocol):
    limits: ClassVar[HttpLimits]
    busy: ClassVar[Throttled]
    busy_answer: ClassVar[bytes]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.busy.warn(max_connections=self.limits.max_connections)
            transport.write(self.busy_answer)
            transport.close()
            return
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        if not self.transport.is_closing():
            self.head_deadline = self.loop.call_later(self.limits.header_timeout_s, self._head_overdue)

    def _cancel_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_overdue(self) -> None:
        """Close the connection unless a request of it is being served (reading its body is the
        app's, under --body-timeout): nothing, half a head, or the rest of a body already answered
        came in time. No answer: there is no request to answer yet."""
        self.head_deadline = None
        serving = self.cycle is not None and not self.cycle.response_complete
        if not serving and not self.transport.is_closing():
            self.transport.close()


def busy_response(limits: HttpLimits) -> bytes:
    """A whole HTTP/1.1 503 in OpenAI's error shape, written before any request is read."""
    message = f"the gateway has {limits.max_connections} connections open (--max-connections); try again"
    body = json.dumps(GatewayError(503, message, code="overloaded").body()).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body
