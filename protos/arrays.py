"""Numpy arrays on the worker link: fixed-width little-endian `bytes` fields, and a sorted index.

A numpy array sent as one `bytes` field costs a copy each way; the same values as a packed repeated
field cost a Python int per element (`.tolist()`, `np.fromiter`). The worker link's codec
(protos/worker_codec.py) uses these helpers at both ends, so they agree on widths and on what a
malformed array is.
"""

from __future__ import annotations

import numpy as np

INT32 = np.dtype("<i4")
INT64 = np.dtype("<i8")


class WireError(ValueError):
    """A field that cannot be what the protocol says it is; the message names the field and why."""


def pack(values: np.ndarray, dtype: np.dtype) -> bytes:
    """`values` as fixed-width little-endian bytes (the caller guarantees they fit `dtype`)."""
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def unpack(data: bytes, dtype: np.dtype, name: str, out: type = np.int64) -> np.ndarray:
    """The values of a `bytes` field, as a fresh array of `out`; WireError unless the length is a
    whole number of values and every value is >= 0 (token and slot ids are never negative)."""
    if not data:
        return np.zeros(0, dtype=out)
    if len(data) % dtype.itemsize:
        raise WireError(f"{name}: {len(data)} bytes is not a whole number of {dtype.itemsize}-byte values")
    values = np.frombuffer(data, dtype=dtype)
    if len(values) and int(values.min()) < 0:
        i = int(np.argmin(values))
        raise WireError(f"{name}: value {int(values[i])} at index {i} is negative")
    return values.astype(out)


def check_range(values: np.ndarray, name: str, low: int, high: int) -> None:
    """WireError unless every value lies in [low, high)."""
    if len(values) and (int(values.min()) < low or int(values.max()) >= high):
        bad = int(values.min()) if int(values.min()) < low else int(values.max())
        raise WireError(f"{name}: value {bad} is outside [{low}, {high})")


class SortedIndex:
    """Positions of keys in an array of distinct keys, found with one vectorised binary search.

    Built once per array (a sort, or only a check when the keys are already in increasing order, as
    handles handed out in admission order are); `positions` costs O(q log n) for q queries, with no
    Python work per key. Built from an array with a repeated key, `duplicate` names one (else None).
    """

    __slots__ = ("_order", "_sorted", "duplicate")

    def __init__(self, keys: np.ndarray) -> None:
        self.duplicate: int | None = None
        if len(keys) < 2 or bool((keys[1:] > keys[:-1]).all()):
            self._order: np.ndarray | None = None  # already sorted: position = index
            self._sorted = keys
            return
        self._order = np.argsort(keys, kind="stable")
        self._sorted = keys[self._order]
        repeats = (self._sorted[1:] == self._sorted[:-1]).nonzero()[0]
        if len(repeats):
            self.duplicate = int(self._sorted[repeats[0]])

    def __len__(self) -> int:
        return len(self._sorted)

    def positions(self, query: np.ndarray) -> np.ndarray:
        """For each query key, its position in the indexed array, or -1 where it is absent."""
        if not len(self._sorted) or not len(query):
            return np.full(len(query), -1, dtype=np.int64)
        at = np.searchsorted(self._sorted, query)
        np.minimum(at, len(self._sorted) - 1, out=at)
        found = at if self._order is None else self._order[at]
        return np.where(self._sorted[at] == query, found, -1)
