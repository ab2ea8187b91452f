"""The flag table's types: each numeric flag states its range once, as its argparse `type=`.

    add("--port", type=flagtypes.PORT, default=50051, help="...")
    add("--drain-timeout", type=flagtypes.Float(0, flagtypes.MAX_SECONDS, unit="seconds"), ...)

argparse calls the type on a command-line value and stepwise/flags.py on a `STEPWISE_*` value, so
both refuse the same values with the same words: `expected an integer in 0..65535, got '70000'`,
which the command prints as one line naming the flag (or the variable) and exits 2. NaN is never in
a range, and infinity only where a bound is infinite (`--request-rate inf`: all at once). Counts that
start processes are capped: a few digits too many must not fork the machine to death.

Every command-line package uses these (control_plane/, data_plane/, gateway/, clients/, stepwise/),
so this is a leaf: it imports nothing of the project (tests/test_layers.py).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

# Wire counts are int32 (gRPC's concurrent-stream limit, the protos' token counts).
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Seeds are uint64 on the wire.
UINT64_MAX = 2**64 - 1
# Token counts of a KV pool (a worker's claim, a host pool): 2**40 is far past any memory.
MAX_TOKENS = 2**40
# Any duration flag: about 11.6 days, longer than anything a timeout, wait or interval means.
MAX_SECONDS = 1_000_000.0
# Processes one flag may start (--frontends, `up --workers`; `up --control-planes` has its own cap).
MAX_PROCESSES = 64
# Seeds: what numpy and random take without complaint.
MAX_SEED = 2**32 - 1

# Words a switch's environment variable may hold (STEPWISE_ENABLE_MIXED_CHUNK=true).
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


@runtime_checkable
class Ranged(Protocol):
    """A flag type that declares its range: what the flag-table test walks every parser for."""

    def __call__(self, text: str) -> object: ...

    def contains(self, value: object) -> bool: ...

    @property
    def expected(self) -> str: ...


def _show(bound: float) -> str:
    if math.isinf(bound):
        return "inf" if bound > 0 else "-inf"
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))


def _refuse(expected: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")


T = TypeVar("T")


def _parsed(kind: Ranged, convert: Callable[[str], T], text: str) -> T:
    """`convert(text)` when it parses and `kind` contains it; the type's one-line refusal otherwise."""
    try:
        value = convert(text)
    except ValueError:
        raise _refuse(kind.expected, text) from None
    if not kind.contains(value):
        raise _refuse(kind.expected, text)
    return value


@dataclass(frozen=True, slots=True)
class Int:
    """argparse type: an integer in lo..hi (both included)."""

    lo: int
    hi: int

    def __call__(self, text: str) -> int:
        return _parsed(self, int, text)

    def contains(self, value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and self.lo <= value <= self.hi

    @property
    def expected(self) -> str:
        return f"an integer in {self.lo}..{self.hi}"


@dataclass(frozen=True, slots=True)
class IntOr(Int):
    """argparse type: `word` itself (e.g. auto), or an integer in lo..hi."""

    word: str = "auto"

    def __call__(self, text: str) -> int | str:  # type: ignore[override]
        return self.word if text == self.word else _parsed(self, int, text)

    def contains(self, value: object) -> bool:
        return value == self.word or Int.contains(self, value)

    @property
    def expected(self) -> str:
        return f"{self.word} or an integer in {self.lo}..{self.hi}"


@dataclass(frozen=True, slots=True)
class Float:
    """argparse type: a number in lo..hi (both included); never NaN, infinite only at an infinite bound."""

    lo: float
    hi: float
    # What the number counts, for the message ("seconds").
    unit: str = ""

    def __call__(self, text: str) -> float:
        return _parsed(self, float, text)

    def contains(self, value: object) -> bool:
        # A comparison with NaN is false, so NaN is never contained.
        return isinstance(value, int | float) and self.lo <= value <= self.hi

    @property
    def expected(self) -> str:
        what = f"a number of {self.unit}" if self.unit else "a number"
        return f"{what} in {_show(self.lo)}..{_show(self.hi)}"


@dataclass(frozen=True, slots=True)
class IntPair:
    """argparse type: `MIN,MAX`, two integers with lo <= MIN <= MAX <= hi; gives (MIN, MAX)."""

    lo: int
    hi: int

    def __call__(self, text: str) -> tuple[int, int]:
        return _parsed(self, _two_ints, text)

    def contains(self, value: object) -> bool:
        if not (isinstance(value, tuple) and len(value) == 2):
            return False
        low, high = value
        bounds = Int(self.lo, self.hi)
        return bounds.contains(low) and bounds.contains(high) and low <= high

    @property
    def expected(self) -> str:
        return f"MIN,MAX with {self.lo} <= MIN <= MAX <= {self.hi}"


def _two_ints(text: str) -> tuple[int, int]:
    low, high = (int(part) for part in text.split(","))  # ValueError unless exactly two integers
    return low, high


PORT = Int(0, 65535)
SEED = Int(0, MAX_SEED)


def count(lo: int = 0, hi: int = INT32_MAX) -> Int:
    """A count of things (requests, tokens, strings): 0.. (or lo..) up to int32."""
    return Int(lo, hi)


def seconds(lo: float = 0.0, hi: float = MAX_SECONDS) -> Float:
    """A duration in seconds; a duration that must be positive gives a small positive lo."""
    return Float(lo, hi, unit="seconds")


def switch(text: str) -> bool:
    """A switch's value in words (TRUE or FALSE, any case); ValueError naming the words otherwise."""
    word = text.strip().lower()
    if word not in TRUE + FALSE:
        raise ValueError(f"not a switch value (use one of {', '.join(TRUE + FALSE)})")
    return word in TRUE
