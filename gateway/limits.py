"""What one HTTP client may cost the gateway: the bytes of a request body, the time it takes to send
a request, and a share of the open connections.

The body is refused while it arrives, never after it is whole: a body is read once as bytes, then
decoded, validated and encoded again, so a request costs a few times its size in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from gateway.errors import GatewayError

MIB = 1024 * 1024
# Twice the control plane's default --max-prompt-bytes (4 MiB of UTF-8): room for JSON's escapes
# (a newline is two bytes, a quote two, a non-ASCII character up to six when the client escapes it).
DEFAULT_MAX_BODY_BYTES = 8 * MIB
DEFAULT_MAX_CONNECTIONS = 1024
# Files the process holds besides its HTTP connections (the listening socket, the gRPC channel, the
# event loop's, the log), with room for one burst of accepts before the connection limit sheds it.
RESERVED_FILES = 64


# Counts a request may hold, checked when its body is validated, before anything is built from it:
# what the control plane would refuse at its default limits (control_plane/config.py, Limits) is
# refused here, never forwarded; what it does not count (messages, content parts, tools) is
# bounded so that one 8 MiB body cannot become hundreds of thousands of models.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPTS = 256
MAX_MESSAGES = 8192
MAX_CONTENT_PARTS = 8192
# OpenAI's own limit on a request's tools.
MAX_TOOLS = 128


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """One `stepwise gateway`'s limits, from its flags."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # From a connection's opening, or its previous response's end, to its next request's whole head.
    header_timeout_s: float = 10.0
    # From a request's head to its whole body.
    body_timeout_s: float = 60.0
    max_connections: int = DEFAULT_MAX_CONNECTIONS


def open_files_limit() -> int | None:
    """RLIMIT_NOFILE's soft limit, the one `accept()` fails at (None: unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def default_max_connections(open_files: int | None) -> int:
    """DEFAULT_MAX_CONNECTIONS, or fewer when the open-file limit leaves less room."""
    if open_files is None:
        return DEFAULT_MAX_CONNECTIONS
    return max(1, min(DEFAULT_MAX_CONNECTIONS, open_files - RESERVED_FILES))


def check_max_connections(max_connections: int, open_files: int | None) -> None:
    """ValueError when the process could not hold that many connections open: past the open-file
    limit `accept()` fails (EMFILE) for everyone, the health checks included."""
    if max_connections < 1:
        raise ValueError("--max-connections must be >= 1")
    if open_files is not None and max_connections + RESERVED_FILES > open_files:
        raise ValueError(
            f"--max-connections {max_connections} needs {max_connections + RESERVED_FILES} open files; "
            f"this process may open {open_files} (ulimit -n)"
        )


async def read_body(request: Request, limits: HttpLimits) -> bytes:
    """The request body, or a refusal before it is whole: 413 past `max_body_bytes` (on the
    Content-Length alone when it declares more; else counted as the bytes arrive, since a body may
    come chunked), 408 when it is not all in within `body_timeout_s`, 499 when the client leaves."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limits.max_body_bytes):
        raise _too_large(limits)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise _too_large(limits)
                chunks.append(chunk)
    except TimeoutError:
        problem = f"the request body did not arrive within {limits.body_timeout_s:g} s (--body-timeout)"
        raise GatewayError(408, problem, code="request_timeout") from None
    except ClientDisconnect:
        raise GatewayError(499, "the client left before its request body was whole") from None
    return b"".join(chunks)


async def discard_body(request: Request, limits: HttpLimits) -> None:
    """Read the body and keep none of it, within the same limits (past them, stop reading: the
    server then closes the connection after the response), so a refusal sent before the body was
    read reaches a client that is still sending it."""
    size = 0
    with contextlib.suppress(TimeoutError, ClientDisconnect):
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    return


def _too_large(limits: HttpLimits) -> GatewayError:
    problem = f"the request body is over {limits.max_body_bytes} bytes (--max-body-bytes)"
    return GatewayError(413, problem, code="request_too_large")
