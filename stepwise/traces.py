"""Trace readers of `stepwise simulate` beyond its own format: the Mooncake trace
(docs/debugging.md#mooncake-traces), and the replay flags every format shares (--time-scale,
--load-scale, --limit).

A Mooncake line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`:
`hash_ids` name the prompt's blocks of `--block-size` tokens in order (the last one may be partial),
and two requests whose lists start with the same ids share that many leading blocks. The reader
derives each block's token ids from its hash id alone, so shared blocks are shared tokens and every
prompt is exactly `input_length` long. The ids are built when the request arrives (a prompt of the
trace is 12k tokens on average; the whole hour would not fit in memory as Python ints).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

import numpy as np

from control_plane.request import RequestParams
from data_plane.sim import TOKEN_FLOOR
from flagtypes import Float, Int
from protos.worker import SamplerParams
from stepwise.simulate import NEVER_EOS, TraceError, TraceRequest, load_trace

TRACE_FORMATS = ("stepwise", "mooncake")
DEFAULT_BLOCK_SIZE = 512
# Room for the hash and the position within its block in one 64-bit word.
_POSITION_BITS = 24


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--trace-format",
        choices=TRACE_FORMATS,
        default="stepwise",
        help="stepwise (this tool's JSON lines) or mooncake (timestamp, input_length, output_length, "
        "hash_ids of prompt blocks)",
    )
    add(
        "--block-size",
        type=Int(1, 1 << _POSITION_BITS),
        default=DEFAULT_BLOCK_SIZE,
        help="mooncake: tokens per hash id (the last block of a prompt may be shorter)",
    )
    add(
        "--time-scale",
        type=Float(1e-6, 1e6),
        default=1.0,
        help="multiply every arrival time by this (0.5 replays twice as fast)",
    )
    add(
        "--load-scale",
        type=Float(1e-6, 1e6),
        default=1.0,
        help="divide every arrival time by this (2 is twice the load)",
    )
    add("--limit", type=Int(0, 1 << 31), default=0, help="replay only the first N requests (0: all)")


def read_trace(ns: argparse.Namespace, vocab_size: int) -> list[TraceRequest]:
    """The trace of `ns.trace` in its format, limited and rescaled as the flags say."""
    limit = ns.limit or None
    if ns.trace_format == "mooncake":
        trace = load_mooncake(ns.trace, vocab_size, ns.block_size, limit)
    else:
        trace = load_trace(ns.trace, vocab_size)[:limit]
    factor = ns.time_scale / ns.load_scale
    if factor != 1.0:
        trace = [dataclasses.replace(r, arrival=r.arrival * factor) for r in trace]
    return trace


def load_mooncake(
    path: Path, vocab_size: int, block_size: int, limit: int | None = None
) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    with path.open() as lines:
        for lineno, text in enumerate(lines, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not text.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                request = parse_mooncake(json.loads(text), f"mc{lineno}", vocab_size, block_size)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON: {exc.msg}") from None
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"{where}: {_reason(exc)}") from None
            if requests and request.arrival < requests[-1].arrival:
                raise TraceError(
                    f"{where}: timestamp {request.arrival * 1000:g} is before the previous line's"
                )
            requests.append(request)
    return requests


def _reason(exc: Exception) -> str:
    return f"missing field {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)


def parse_mooncake(obj: object, rid: str, vocab_size: int, block_size: int) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    timestamp = _number(obj, "timestamp")
    length = _count(obj, "input_length", 1)
    output = _count(obj, "output_length", 1)
    hashes = obj["hash_ids"]
    if not isinstance(hashes, list) or not all(type(h) is int and 0 <= h < 1 << 39 for h in hashes):
        raise ValueError("hash_ids: wants a list of integers in [0, 2^39)")
    blocks = -(-length // block_size)
    if len(hashes) != blocks:
        raise ValueError(
            f"hash_ids: {len(hashes)} ids for input_length {length} in blocks of {block_size} "
            f"(wants {blocks})"
        )
    # Exactly output_length tokens: the simulated model never ends a trace request early.
    params = RequestParams(
        max_new_tokens=output, sampler=SamplerParams(temperature=0.0), sim_output_len=NEVER_EOS
    )
    prompt = BlockPrompt(tuple(hashes), length, block_size, vocab_size)
    return TraceRequest(rid, timestamp / 1000.0, prompt, params)


def _number(obj: dict[str, object], name: str) -> float:
    value = obj[name]
    if type(value) not in (int, float) or not 0 <= value < 1e15:  # type: ignore[operator]
        raise ValueError(f"{name}: wants a number of milliseconds >= 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _count(obj: dict[str, object], name: str, lo: int) -> int:
    value = obj[name]
    if type(value) is not int or not lo <= value < 1 << 31:
        raise ValueError(f"{name}: wants an integer >= {lo}, got {value!r}")
    return value


class BlockPrompt(Sequence[int]):
    """A prompt of hashed blocks; its token ids are built when it is read (`block_tokens`)."""

    def __init__(self, hashes: tuple[int, ...], length: int, block_size: int, vocab_size: int) -> None:
        self.hashes = hashes
        self.length = length
        self.block_size = block_size
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.length

    def ids(self) -> list[int]:
        size = self.block_size
        parts = [block_tokens(h, size, self.vocab_size) for h in self.hashes]
        if not parts:
            return []
        return np.concatenate(parts)[: self.length].tolist()  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self.ids()[index]


def block_tokens(hash_id: int, size: int, vocab_size: int) -> np.ndarray:
    """`size` token ids in [TOKEN_FLOOR, vocab) that are a function of the hash id alone
    (splitmix64 of hash and position): a partial block is a prefix of the whole one."""
    z = (np.uint64(hash_id) << np.uint64(_POSITION_BITS)) + np.arange(size, dtype=np.uint64)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(vocab_size - TOKEN_FLOOR) + np.uint64(TOKEN_FLOOR)).astype(np.int64)
