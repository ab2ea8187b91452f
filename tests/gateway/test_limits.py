"""The gateway's limits on what one client may cost it, without a process: the body reader against
a hand-fed ASGI receive, the connection-limit arithmetic, and the once-per-interval warning."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.requests import Request

from gateway import connections
from gateway.connections import AcceptErrorLog, Throttled
from gateway.errors import GatewayError
from gateway.limits import (
    DEFAULT_MAX_CONNECTIONS,
    RESERVED_FILES,
    HttpLimits,
    check_max_connections,
    default_max_connections,
    read_body,
)

LIMITS = HttpLimits(max_body_bytes=100, body_timeout_s=0.2)


Message = dict[str, Any]


def request(messages: list[Message], headers: dict[str, str] | None = None) -> tuple[Request, list[int]]:
    """A Request whose body arrives as `messages`; then it waits forever. Also: how many were read."""
    read = [0]

    async def receive() -> dict[str, Any]:
        if read[0] < len(messages):
            read[0] += 1
            return messages[read[0] - 1]
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    raw_headers = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": "/", "headers": raw_headers, "query_string": b""}
    return Request(scope, receive), read


def chunk(data: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


async def refused(body: Callable[[], Awaitable[bytes]]) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        await body()
    return caught.value


async def test_a_body_within_the_limit_is_read_whole() -> None:
    req, _ = request([chunk(b"a" * 60), chunk(b"b" * 40, more=False)])
    assert await read_body(req, LIMITS) == b"a" * 60 + b"b" * 40


async def test_a_body_over_the_limit_is_refused_as_it_arrives() -> None:
    """Chunked, no Content-Length: refused on the chunk that crosses the limit, the rest unread."""
    req, read = request([chunk(b"a" * 60), chunk(b"b" * 60), chunk(b"c" * 60, more=False)])
    error = await refused(lambda: read_body(req, LIMITS))
    assert (error.status, error.code, read[0]) == (413, "request_too_large", 2)
    assert "--max-body-bytes" in error.message


@pytest.mark.parametrize("declared", ["101", "9" * 5000])
async def test_a_declared_length_over_the_limit_is_refused_before_any_byte(declared: str) -> None:
    req, read = request([chunk(b"a", more=False)], {"content-length": declared})
    assert ((await refused(lambda: read_body(req, LIMITS))).status, read[0]) == (413, 0)


async def test_a_body_that_stops_arriving_is_a_408() -> None:
    req, _ = request([chunk(b"a" * 10)])
    error = await refused(lambda: read_body(req, LIMITS))
    assert (error.status, error.code) == (408, "request_timeout") and "--body-timeout" in error.message


async def test_a_client_that_leaves_mid_body_is_a_499() -> None:
    req, _ = request([chunk(b"a" * 10), {"type": "http.disconnect"}])
    assert (await refused(lambda: read_body(req, LIMITS))).status == 499


def test_the_default_connection_limit_fits_the_open_file_limit() -> None:
    assert default_max_connections(None) == DEFAULT_MAX_CONNECTIONS
    assert default_max_connections(1_000_000) == DEFAULT_MAX_CONNECTIONS
    assert default_max_connections(1024) == 1024 - RESERVED_FILES
    assert default_max_connections(10) == 1
    check_max_connections(1024 - RESERVED_FILES, 1024)
    check_max_connections(10**6, None)
    with pytest.raises(ValueError, match=r"--max-connections 1000 needs 1064 open files; .* 1024"):
        check_max_connections(1000, 1024)
    with pytest.raises(ValueError, match="must be >= 1"):
        check_max_connections(0, None)


def test_a_throttled_warning_is_logged_once_per_interval_with_its_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logged: list[dict[str, object]] = []
    monkeypatch.setattr(connections.log, "warning", lambda event, **fields: logged.append(fields))
    now = [100.0]
    warning = Throttled("x", interval_s=10, clock=lambda: now[0])
    for _ in range(2048):  # one failed accept() makes CPython 3.11 try up to the backlog
        warning.warn()
    now[0] += 10
    warning.warn()
    assert [f["times"] for f in logged] == [1, 2048]


def test_the_loop_handler_throttles_failed_accepts_only(monkeypatch: pytest.MonkeyPatch) -> None:
    logged: list[dict[str, object]] = []
    monkeypatch.setattr(connections.log, "warning", lambda event, **fields: logged.append(fields))
    others: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    try:
        monkeypatch.setattr(loop, "default_exception_handler", others.append)
        handler = AcceptErrorLog()
        emfile = {"message": connections.ACCEPT_OUT_OF_RESOURCES, "exception": OSError(24, "Too many files")}
        for _ in range(500):
            handler(loop, emfile)
        handler(loop, {"message": "something else"})
    finally:
        loop.close()
    assert len(logged) == 1 and "Too many files" in str(logged[0]["error"])
    assert others == [{"message": "something else"}]
