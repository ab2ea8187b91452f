"""A gateway worker process's entry point (`stepwise gateway --workers N`, N > 1): what the
supervisor (gateway/workers.py) starts, with multiprocessing's spawn.

It lives here rather than in gateway/ because it sets up what every entry point sets up (logging,
dying with its parent) before it hands over to the gateway's own serve().
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from multiprocessing.connection import Connection

import structlog

from gateway.app import GatewayConfig
from gateway.server import serve
from gateway.workers import join_port
from stepwise import logs
from stepwise.parent import die_with_parent_pid


def main(
    config: GatewayConfig, host: str, port: int, index: int, log_level: str, ready: Connection, parent: int
) -> None:
    """Process entry (`parent` is the supervisor's pid: the worker dies with it). Sends its pid on
    `ready` once it accepts connections."""
    die_with_parent_pid(parent)
    logs.configure(log_level)
    structlog.contextvars.bind_contextvars(gateway_worker=index)
    sock = join_port(host, port)

    def accepting() -> None:
        ready.send(os.getpid())
        ready.close()

    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(serve(config, sock, log_level, None, accepting)))
