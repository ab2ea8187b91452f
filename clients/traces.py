"""Request traces, read the same way by `stepwise simulate` (stepwise/simulate.py, stepwise/traces.py)
and by `stepwise bench --dataset trace` (clients/bench.py), so a simulated run and a live run are the
same workload: the same requests, prompt ids, output lengths and arrival times.

Two formats (`--trace-format`):

- stepwise: JSON lines with `rid`, `arrival` (seconds, lines sorted by it), a prompt as `prompt_ids` or
  `prompt_len` (+ `prefix_group`, `prefix_len`: a group's requests share their first prefix_len tokens),
  `max_new_tokens`, and optionally `output_len` (tokens before EOS; default: never EOS), `priority`,
  `routing_key`, `ignore_eos`, `abort_at`, `tenant`, `ttft_slo_ms`, `tpot_slo_ms`
  (docs/debugging.md#simulating-a-trace).
- mooncake (docs/debugging.md#mooncake-traces): `{"timestamp": ms, "input_length": n, "output_length": m,
  "hash_ids": [...]}`: `hash_ids` name the prompt's blocks of `--block-size` tokens in order (the last one
  may be partial), and two requests whose lists start with the same ids share that many leading blocks.
  Each block's token ids are derived from its hash id alone, so shared blocks are shared tokens and every
  prompt is exactly `input_length` long. The ids are built when they are read (a prompt of the trace is
  12k tokens on average; the whole hour would not fit in memory as Python ints).

The replay flags every format shares: --time-scale, --load-scale, --limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np

from clients.datasets import FIRST_TOKEN_ID
from flagtypes import Float, Int
from flagtypes.table import Flag, Flags

TRACE_FORMATS = ("stepwise", "mooncake")
DEFAULT_BLOCK_SIZE = 512
# Without an output length a request never emits EOS (it runs to max_new_tokens).
NEVER_EOS = 2**31 - 1
# Room for the hash and the position within its block in one 64-bit word.
_POSITION_BITS = 24


class TraceError(ValueError):
    """A trace line that cannot be read; the message names the line and field."""


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One request of a trace, as the file says it (no scheduler types: clients/ reads it too)."""

    rid: str
    arrival: float
    input_ids: Sequence[int]
    max_new_tokens: int | None
    # Tokens before the simulated model's EOS (NEVER_EOS: none).
    output_len: int = NEVER_EOS
    ignore_eos: bool = False
    priority: int | None = None
    routing_key: str = ""
    # When the client cancels it, in seconds (None: never).
    abort_at: float | None = None
    # Whose request it is, and its latency objectives in milliseconds (0: none).
    tenant: str = ""
    ttft_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0

    @property
    def output_tokens(self) -> int | None:
        """The tokens it generates when nothing cuts it short: the fewer of max_new_tokens and (unless
        EOS is ignored) output_len; None when the trace bounds neither."""
        bounds = [self.max_new_tokens] if self.max_new_tokens is not None else []
        if not self.ignore_eos and self.output_len != NEVER_EOS:
            bounds.append(self.output_len)
        return min(bounds) if bounds else None


# How a trace file is read (bench and simulate).
TRACE_FLAGS = Flags(
    None,
    (
        Flag(
            "--trace-format",
            choices=TRACE_FORMATS,
            default="stepwise",
            help="stepwise (this tool's JSON lines) or mooncake (timestamp, input_length, output_length, "
            "hash_ids of prompt blocks)",
        ),
        Flag(
            "--block-size",
            Int(1, 1 << _POSITION_BITS),
            default=DEFAULT_BLOCK_SIZE,
            help="mooncake: tokens per hash id (the last block of a prompt may be shorter)",
        ),
        Flag(
            "--time-scale",
            Float(1e-6, 1e6),
            default=1.0,
            help="multiply every arrival time by this (0.5 replays twice as fast)",
        ),
        Flag(
            "--load-scale",
            Float(1e-6, 1e6),
            default=1.0,
            help="divide every arrival time by this (2 is twice the load)",
        ),
        Flag("--limit", Int(0, 1 << 31), default=0, help="replay only the first N requests (0: all)"),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    TRACE_FLAGS.add_to(parser)


def read_trace(ns: argparse.Namespace, vocab_size: int) -> list[TraceEntry]:
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


# --- the stepwise format --------------------------------------------------------------------------


def load_trace(path: Path, vocab_size: int) -> list[TraceEntry]:
    requests: list[TraceEntry] = []
    for lineno, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(text)
            if isinstance(obj, dict) and "event" in obj:
                continue  # a fleet event (a worker killed, drained, added): the simulator's, not a request
            request = parse_request(obj, vocab_size)
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{where}: {exc!s}") from None
        if requests and request.arrival < requests[-1].arrival:
            raise TraceError(f"{where}: arrival {request.arrival} is before the previous line's")
        requests.append(request)
    return requests


def parse_request(obj: dict[str, object], vocab_size: int) -> TraceEntry:
    rid = str(obj["rid"])
    max_new = obj.get("max_new_tokens")
    priority = obj.get("priority")
    arrival = float(obj.get("arrival", 0.0))  # type: ignore[arg-type]
    return TraceEntry(
        rid,
        arrival,
        prompt_ids(rid, obj, vocab_size),
        max_new_tokens=None if max_new is None else int(max_new),  # type: ignore[call-overload]
        output_len=int(obj.get("output_len", NEVER_EOS)),  # type: ignore[call-overload]
        ignore_eos=bool(obj.get("ignore_eos", False)),
        priority=None if priority is None else int(priority),  # type: ignore[call-overload]
        routing_key=str(obj.get("routing_key", "")),
        abort_at=abort_time(obj, arrival),
        tenant=str(obj.get("tenant", "")),
        ttft_slo_ms=_slo_ms(obj, "ttft_slo_ms"),
        tpot_slo_ms=_slo_ms(obj, "tpot_slo_ms"),
    )


def _slo_ms(obj: dict[str, object], name: str) -> float:
    value = obj.get(name, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e12:
        raise ValueError(f"{name}: want milliseconds >= 0 (0: none), got {value!r}")
    return float(value)


def abort_time(obj: dict[str, object], arrival: float) -> float | None:
    """The optional `abort_at`: a finite number of seconds, not before the request's arrival."""
    value = obj.get("abort_at")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"abort_at: want seconds on the simulated clock (a number), got {value!r}")
    if value < arrival:
        raise ValueError(f"abort_at: {value} is before the request's arrival ({arrival})")
    return float(value)


def prompt_ids(rid: str, obj: dict[str, object], vocab_size: int) -> tuple[int, ...]:
    """`prompt_ids` as given, or `prompt_len` ids: a group's shared prefix, then the request's own."""
    if "prompt_ids" in obj:
        return tuple(int(t) for t in obj["prompt_ids"])  # type: ignore[attr-defined]
    length = int(obj["prompt_len"])  # type: ignore[call-overload]
    group = obj.get("prefix_group")
    shared = min(int(obj.get("prefix_len", 0)), length) if group is not None else 0  # type: ignore[call-overload]
    prefix = token_run(f"group/{group}", shared, vocab_size)
    return prefix + token_run(f"rid/{rid}", length - shared, vocab_size)


def token_run(name: str, n: int, vocab_size: int) -> tuple[int, ...]:
    """n ids in [FIRST_TOKEN_ID, vocab), a function of the name alone (PCG64 is stable across platforms)."""
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return tuple(np.random.default_rng(seed).integers(FIRST_TOKEN_ID, vocab_size, n).tolist())


# --- the Mooncake format --------------------------------------------------------------------------


def load_mooncake(path: Path, vocab_size: int, block_size: int, limit: int | None = None) -> list[TraceEntry]:
    requests: list[TraceEntry] = []
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


def parse_mooncake(obj: object, rid: str, vocab_size: int, block_size: int) -> TraceEntry:
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
    prompt = BlockPrompt(tuple(hashes), length, block_size, vocab_size)
    return TraceEntry(rid, timestamp / 1000.0, prompt, max_new_tokens=output)


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
    """`size` token ids in [FIRST_TOKEN_ID, vocab) that are a function of the hash id alone
    (splitmix64 of hash and position): a partial block is a prefix of the whole one."""
    z = (np.uint64(hash_id) << np.uint64(_POSITION_BITS)) + np.arange(size, dtype=np.uint64)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(vocab_size - FIRST_TOKEN_ID) + np.uint64(FIRST_TOKEN_ID)).astype(np.int64)
