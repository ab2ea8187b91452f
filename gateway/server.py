"""`stepwise gateway`: flags, and uvicorn serving the app on a socket bound before it starts.

Binding the socket here (not in uvicorn) lets `--port 0` work: the bound port goes to
`--ready-file` once uvicorn accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from pathlib import Path

import uvicorn

from clients.client import add_tls_ca_argument
from flagtypes import PORT
from gateway.app import GatewayConfig, create_app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--control",
        default="127.0.0.1:50051",
        help="control plane client address: HOST:PORT or a gRPC target such as dns:///NAME:PORT",
    )
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    parser.add_argument("--port", type=PORT, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--model", default="embedded", help="model directory (its chat template) or embedded")
    parser.add_argument(
        "--served-model-name", default=None, help="the model id clients see (default: the directory name)"
    )
    add_tls_ca_argument(parser)
    parser.add_argument("--ready-file", type=Path, default=None, help="write the bound port here as JSON")


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


async def serve(config: GatewayConfig, sock: socket.socket, log_level: str, ready_file: Path | None) -> int:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers); write `ready_file` once accepting."""
    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if ready_file is not None and server.started:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": sock.getsockname()[1]}))
        tmp.rename(ready_file)
    await task
    return 0 if server.started else 1
