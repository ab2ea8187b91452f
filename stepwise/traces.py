"""The trace flags and readers of `stepwise simulate`: clients/traces.py reads both formats (so
`stepwise bench --dataset trace` sends the same workload live), and this module gives its lines as the
scheduler takes them (simulate.TraceRequest). Kept for the modules that import `stepwise.traces`."""

from __future__ import annotations

import argparse
from pathlib import Path

from clients import traces as client_traces
from clients.traces import (
    DEFAULT_BLOCK_SIZE,
    TRACE_FORMATS,
    BlockPrompt,
    add_arguments,
    block_tokens,
)
from stepwise.simulate import TraceRequest, to_request

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "TRACE_FORMATS",
    "BlockPrompt",
    "add_arguments",
    "block_tokens",
    "load_mooncake",
    "read_trace",
]


def read_trace(ns: argparse.Namespace, vocab_size: int) -> list[TraceRequest]:
    """The trace of `ns.trace` in its format, limited and rescaled as the flags say."""
    return [to_request(entry) for entry in client_traces.read_trace(ns, vocab_size)]


def load_mooncake(
    path: Path, vocab_size: int, block_size: int, limit: int | None = None
) -> list[TraceRequest]:
    return [to_request(e) for e in client_traces.load_mooncake(path, vocab_size, block_size, limit)]
