"""A frontend process's entry point: what the core's supervisor starts, with multiprocessing's spawn.

It lives above both processes because it sets up what every entry point sets up (logging, dying
with its parent) before it hands over to the frontend's own serve().
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import structlog

from control_plane.config import ControlConfig
from control_plane.frontend.server import serve
from stepwise import logs
from stepwise.parent import die_with_parent_pid


def main(config: ControlConfig, index: int, link_path: str, port: int, log_level: str, parent: int) -> None:
    """Process entry (`parent` is the core's pid: the frontend dies with it)."""
    die_with_parent_pid(parent)
    logs.configure(log_level)
    structlog.contextvars.bind_contextvars(frontend=index)
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(serve(config, index, link_path, port)))
