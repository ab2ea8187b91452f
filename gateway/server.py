"""`stepwise gateway`: flags, and uvicorn serving the app on a socket bound before it starts.

Binding the socket here (not in uvicorn) lets `--port 0` work: the bound port goes to
`--ready-file` once uvicorn accepts connections. With `--workers N` (N > 1) the process binds the
port and supervises N worker processes that serve it (gateway/workers.py).

SIGTERM (and SIGINT) drain: uvicorn stops accepting, lets in-flight responses finish for up to
GRACEFUL_S, then the process exits, 0 after SIGTERM (130 after SIGINT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

from clients.client import add_tls_ca_argument
from flagtypes import MAX_PROCESSES, PORT, Int, count, seconds
from flagtypes.table import Flag, Flags
from gateway.app import GatewayConfig, create_app
from gateway.connections import AcceptErrorLog, protocol_class
from gateway.limits import (
    DEFAULT_MAX_CONNECTIONS,
    HttpLimits,
    check_max_connections,
    default_max_connections,
    open_files_limit,
)
from gateway.templates import NAMED
from gateway.tools import PARSER_NAMES

# uvicorn's graceful shutdown: seconds in-flight responses get to finish after SIGTERM or SIGINT.
GRACEFUL_S = 5


def _max_connections(given: int | None) -> int:
    """--max-connections, or as many as the open-file limit leaves room for; ValueError naming the
    flag for a count the process could not hold open."""
    open_files = open_files_limit()
    if given is None:
        return default_max_connections(open_files)
    check_max_connections(given, open_files)
    return given


_D = HttpLimits()
# The gateway's flags, in --help's order (its --tls-ca is the clients' own, clients/client.py).
_SERVER = Flags(
    None,
    (
        Flag(
            "--control",
            default="127.0.0.1:50051",
            help="control plane client address: HOST:PORT or a gRPC target such as dns:///NAME:PORT",
        ),
        Flag("--host", default="127.0.0.1", help="HTTP bind address"),
        Flag("--port", PORT, default=8000, help="HTTP port (0: any free port)"),
        Flag(
            "--model",
            default="embedded",
            help="the control plane's model: a directory, a Hub id in the local cache, or a named model "
            "(its chat template and tokenizer)",
        ),
        Flag(
            "--served-model-name",
            nargs="+",
            metavar="NAME",
            help="the model ids clients may name (a request naming another is a 404 model_not_found); the "
            "first is the one /v1/models reports first and answers default to (default: a named model's "
            "name, a Hub id without its revision, else the directory's name; STEPWISE_SERVED_MODEL_NAME "
            "holds one name)",
        ),
    ),
)
TEMPLATE_FLAGS = Flags(
    None,
    (
        Flag(
            "--chat-template",
            metavar="FILE|NAME",
            help="the chat template chat completions render with instead of the model's: a Jinja file, or "
            f"a template shipped with Stepwise ({', '.join(NAMED)}: ChatML with Hermes tool calling); "
            "default: the model's own, except a named model whose own renders no tools (stepwise models)",
        ),
        Flag(
            "--tool-call-parser",
            choices=tuple(PARSER_NAMES),
            help="how chat completions with tool_choice auto read tool calls from the model's text: hermes "
            "(<tool_call>{...}</tool_call>, Hermes, Qwen and the shipped templates) or llama3_json "
            '(llama3-json, llama3: a bare {"name", "parameters"} object, Llama 3.1+); default: the format '
            "the chat template teaches, else hermes",
        ),
    ),
)
_PROCESSES = Flags(
    None,
    (
        Flag(
            "--workers",
            Int(1, MAX_PROCESSES),
            default=1,
            help="gateway processes serving the port (SO_REUSEPORT; each one's limits are its own); past "
            "1, this process supervises them: it restarts one that exits, and SIGTERM drains them all. "
            "At most one per core the gateway may use (sizing: docs/performance.md#the-gateway)",
        ),
        Flag(
            "--ready-file",
            Path,
            help="write the bound port here as JSON once every process accepts (with --workers past 1 "
            "also the supervisor's pid and the workers' pids)",
        ),
    ),
)
LIMIT_FLAGS = Flags(
    HttpLimits,
    (
        Flag(
            "--max-body-bytes",
            Int(1, 2**40),
            help="a request body past this many bytes is a 413, before it is read whole "
            f"({_D.max_body_bytes})",
        ),
        Flag(
            "--header-timeout",
            seconds(0.001),
            field="header_timeout_s",
            help="seconds a connection has to send a whole request head, from its opening or its previous "
            f"response's end; then it is closed ({_D.header_timeout_s:g})",
        ),
        Flag(
            "--body-timeout",
            seconds(0.001),
            field="body_timeout_s",
            help="seconds a request has to send its whole body once its head is in; then 408 "
            f"({_D.body_timeout_s:g})",
        ),
        Flag(
            "--max-connections",
            count(1),
            default=None,
            to=_max_connections,
            help="open HTTP connections at most, per process with --workers; one more is answered 503 "
            f"(Retry-After: 1) and closed (default {DEFAULT_MAX_CONNECTIONS}, or the open-file limit less "
            "the process's own files)",
        ),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _SERVER.add_to(parser)
    add_template_arguments(parser)
    add_tls_ca_argument(parser)
    _PROCESSES.add_to(parser)
    LIMIT_FLAGS.add_to(parser)


def add_template_arguments(parser: argparse.ArgumentParser) -> None:
    """--chat-template and --tool-call-parser (the gateway's, and `up`'s to pass on to it)."""
    TEMPLATE_FLAGS.add_to(parser)


def limits_from_args(ns: argparse.Namespace) -> HttpLimits:
    """The flags as HttpLimits; ValueError naming the flag for a value that cannot work."""
    return HttpLimits(**LIMIT_FLAGS.values(ns))  # type: ignore[arg-type]


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket; OSError (a taken port) names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    return sock


async def serve(
    config: GatewayConfig,
    sock: socket.socket,
    log_level: str,
    ready_file: Path | None,
    accepting: Callable[[], None] | None = None,
) -> int:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers); write `ready_file` and call `accepting`
    once accepting. 0 after a SIGTERM's drain; SIGINT's ends in KeyboardInterrupt, as Python's does."""
    asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
    app = create_app(config)
    http = protocol_class(config.limits)
    server = uvicorn.Server(
        uvicorn.Config(
            app, http=http, log_level=log_level, access_log=False, timeout_graceful_shutdown=GRACEFUL_S
        )
    )
    # uvicorn raises the signal again once it has drained, for the handler it found: Python's default
    # for SIGTERM would end the process by the signal. Its own handler here, a SIGTERM before uvicorn
    # takes over is a drain too, and the one raised again changes nothing.
    main = threading.current_thread() is threading.main_thread()  # signals are the main thread's
    previous = signal.signal(signal.SIGTERM, server.handle_exit) if main else None
    try:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            if ready_file is not None:
                tmp = ready_file.with_suffix(".tmp")
                tmp.write_text(json.dumps({"port": sock.getsockname()[1]}))
                tmp.rename(ready_file)
            if accepting is not None:
                accepting()
        await task
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 1
