"""Logging: configured once per entry point. Human-readable on a terminal, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys

import structlog

# What --log-level takes (any case): the levels the processes log at.
LEVELS = ("debug", "info", "warning", "error")


def configure(level: str = "info", json: bool | None = None) -> None:
    """Route structlog to stderr; `json=None` picks JSON when stderr is not a TTY."""
    use_json = not sys.stderr.isatty() if json is None else json
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
