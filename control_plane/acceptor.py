"""A grpc.aio server that keeps several requests for new calls outstanding with gRPC's core.

grpc.aio's server (grpcio 1.85) keeps one request for the next call per registered method, and one
for every other method, outstanding with the C core, and makes the next only after the last
accepted call has reached the event loop and the server's own task has run again: about six loop
turns per call. A loop busy streaming has long turns, so it accepts few calls a second however
short their handlers: 80 a second at 2 ms a turn (`bench/bench_grpc_floor.py`), where the 4 × 128
streams of `bench/bench_control.py` keep a frontend's turns.

`server(depth=N)` keeps N requests outstanding per method instead, and hands grpc.aio's task a call
that is already matched whenever one is waiting: a call then costs about two turns, the floor of
that task's own loop (it waits on a future, then runs). At 2 ms a turn 228-230 calls a second were
accepted at depths 4, 16 and 64, against 80 at one. It overrides the one method grpc.aio's task
asks for its next call's future (`_make_request_call_future`, private API): `installed()` says
whether this grpcio has it, and `server()` falls back to grpc.aio's own server where it does not.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)

# Outstanding requests per method. Each costs the C core one pending request (a few hundred bytes).
# 4 accepted as many calls a second as 64 (grpc.aio's task takes one call per two turns whatever the
# depth); 8 leaves room for callers that arrive together.
ACCEPT_DEPTH = 8

try:  # private: grpc.aio's Cython server, whose serving task asks this method for each next call
    from grpc._cython import cygrpc
    from grpc.aio import _server as aio_server

    _AioServer: Any = cygrpc.AioServer
    _Server: Any = aio_server.Server
    _PRIVATE_API = all(
        (
            hasattr(_AioServer, "_make_request_call_future"),
            hasattr(cygrpc, "get_working_loop"),
            hasattr(aio_server, "_augment_channel_arguments"),
        )
    )
except (ImportError, AttributeError):  # pragma: no cover (a grpcio without them)
    _AioServer, _Server, _PRIVATE_API = object, object, False


def installed() -> bool:
    """Whether this grpcio has what `server(depth > 1)` overrides."""
    return _PRIVATE_API


class _Requests:
    """The outstanding requests of one method (None: every unregistered method) and the calls they
    matched that the server's task has not taken yet."""

    def __init__(self, server: _DeepServer, method: bytes | None) -> None:
        self.server, self.method = server, method
        self.outstanding = 0
        self.matched: deque[asyncio.Task[Any]] = deque()
        self.taker: asyncio.Future[Any] | None = None

    def next_call(self) -> asyncio.Future[Any]:
        """A future of the next matched call's state (or of its request's error), for the task."""
        self.top_up()
        taker: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.matched:
            _settle(taker, self.matched.popleft())
        else:
            self.taker = taker
        return taker

    def top_up(self) -> None:
        while self.outstanding < self.server.depth and self.server.is_running():
            request = self.server.request(self.method)
            self.outstanding += 1
            request.add_done_callback(self._matched)

    def _matched(self, request: asyncio.Task[Any]) -> None:
        self.outstanding -= 1
        taker, self.taker = self.taker, None
        if taker is not None and not taker.done():
            _settle(taker, request)  # shutting down, it is the error that wakes the task to stop
        elif not self.server.is_running():  # shutting down: the C core fails every request left
            if not request.cancelled():
                request.exception()  # retrieved, so asyncio does not log it
        elif not request.cancelled():
            self.matched.append(request)
        self.top_up()


def _settle(taker: asyncio.Future[Any], request: asyncio.Task[Any]) -> None:
    if request.cancelled():
        taker.cancel()
    elif (exc := request.exception()) is not None:
        taker.set_exception(exc)
    else:
        taker.set_result(request.result())


class _DeepServer(_AioServer):  # type: ignore[misc]
    """grpc.aio's Cython server with `depth` requests outstanding per method."""

    def __init__(self, depth: int, *args: Any) -> None:
        super().__init__(*args)
        self.depth = depth
        self._requests: dict[bytes | None, _Requests] = {}

    def request(self, method: bytes | None) -> asyncio.Task[Any]:
        """One more request for a call of `method`, made with the C core now (grpc.aio's own)."""
        task: asyncio.Task[Any] = super()._make_request_call_future(method)
        return task

    def _make_request_call_future(self, method: bytes | None) -> asyncio.Future[Any]:
        requests = self._requests.get(method)
        if requests is None:
            requests = self._requests[method] = _Requests(self, method)
        return requests.next_call()


class _DeepAioServer(_Server):  # type: ignore[misc]
    """grpc.aio's `Server` on a `_DeepServer`; made as `grpc.aio.server(options=...)` makes its own."""

    def __init__(self, options: Sequence[tuple[str, Any]], depth: int) -> None:
        self._loop = cygrpc.get_working_loop()
        augmented = aio_server._augment_channel_arguments(tuple(options), None)
        self._server = _DeepServer(depth, self._loop, None, (), (), augmented, None)


def server(options: Sequence[tuple[str, Any]] = (), depth: int = ACCEPT_DEPTH) -> grpc.aio.Server:
    """A grpc.aio server (as `grpc.aio.server(options=options)`) keeping `depth` requests for new
    calls outstanding per method; grpc.aio's own server where depth is 1 or the API is missing."""
    if depth > 1 and _PRIVATE_API:
        made: grpc.aio.Server = _DeepAioServer(options, depth)
        return made
    if depth > 1:
        log.warning("grpcio lacks the server hook: one request for new calls outstanding")
    return grpc.aio.server(options=options)
