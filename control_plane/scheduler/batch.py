"""The running batch (columnar, for the decode hot path) and the batch a plan was built from."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from control_plane.request import Request
from control_plane.scheduler.columns import RowColumns
from protos.worker import StepKind


def _objects(reqs: Sequence[Request]) -> np.ndarray:
    out = np.empty(len(reqs), dtype=object)
    out[:] = reqs
    return out


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


# Empty columns are shared (read-only: nothing writes into an array it did not make), not made anew
# for each of a plan's five decode columns and each emptied batch.
_NO_OBJECTS = _read_only(np.empty(0, dtype=object))
_NO_INTS = _read_only(np.zeros(0, dtype=np.int64))


def _no_objects() -> np.ndarray:
    return _NO_OBJECTS


def _no_ints() -> np.ndarray:
    return _NO_INTS


class RunningBatch:
    """Requests being decoded, in batch order, as three parallel arrays: the Request objects, their
    rows, and the serial of each row's tenancy when the request joined.

    A request that finishes leaves its row at once (the row may even be reused) but stays in the batch
    until the next filter, as in SGLang (docs/scheduler.md#step-loop: admission still counts it); such a
    position is the one whose row serial has moved on (`live_mask`). Membership changes are array
    operations (merge appends, filters index); a decode step touches only the columns.
    """

    def __init__(self, columns: RowColumns) -> None:
        self.columns = columns
        self.req_array = _no_objects()
        self.rows = _no_ints()
        self.serials = _no_ints()
        # SGLang's ScheduleBatch.batch_is_full (docs/scheduler.md#batch-is-full): set by admission when
        # no request may join (no row, the running cap, or NO_TOKEN); while set and no request is
        # mid-chunk, no admission is attempted. The batch clears it whenever it loses a member; the
        # merge clears it when the last prefill batch joins an empty running batch (in SGLang it becomes
        # the running batch, bringing its own False).
        self.batch_is_full = False

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def reqs(self) -> list[Request]:
        """The requests in batch order (a new list)."""
        return self.req_array.tolist()  # type: ignore[no-any-return]

    @property
    def seq_lens(self) -> np.ndarray:
        """Positions with a slot, per request: where its next decode writes."""
        return self.columns.allocated[self.rows]

    def live_mask(self) -> np.ndarray:
        """Per position: the request still holds its row (it has not finished)."""
        return self.columns.serial[self.rows] == self.serials

    def append(self, reqs: np.ndarray, rows: np.ndarray, serials: np.ndarray) -> None:
        self.req_array = np.concatenate((self.req_array, reqs))
        self.rows = np.concatenate((self.rows, rows))
        self.serials = np.concatenate((self.serials, serials))

    def merge(self, reqs: Sequence[Request]) -> None:
        """Append requests that hold rows, in this order."""
        rows = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
        self.append(_objects(reqs), rows, self.columns.serial[rows])

    def keep(self, selection: np.ndarray | list[int]) -> None:
        """Keep these positions (indices, in this order, or a boolean mask). A batch that shrank is
        no longer full (SGLang resets the flag after a filter that dropped a finished request, a
        retraction and a preemption alike)."""
        before = len(self.rows)
        self.req_array = self.req_array[selection]
        self.rows = self.rows[selection]
        self.serials = self.serials[selection]
        if len(self.rows) < before:
            self.batch_is_full = False

    def empty(self) -> None:
        """Every request left for a mixed step (docs/scheduler.md#mixed-chunk). The flag stays: SGLang
        replaces the running batch by an empty one carrying the same batch_is_full."""
        self.req_array, self.rows, self.serials = _no_objects(), _no_ints(), _no_ints()

    def mark_full(self) -> None:
        """Admission found no room for another request (docs/scheduler.md#admission-loop steps 5, 9b, 9g)."""
        self.batch_is_full = True

    def clear_full(self) -> None:
        """Room may have appeared (docs/scheduler.md#batch-is-full): the last prefill batch lost members
        before joining or joins an empty running batch, the batch is empty at the decode step, or
        priority preemption retries every pass."""
        self.batch_is_full = False

    def filter_finished(self) -> bool:
        """Drop finished requests; returns whether any were dropped."""
        live = self.live_mask()
        if live.all():
            return False
        self.keep(live)
        return True

    def remove(self, drop: Iterable[Request]) -> None:
        gone = {id(r) for r in drop}
        self.keep(np.fromiter((id(r) not in gone for r in self.req_array), dtype=bool, count=len(self)))

    def remaining_new_tokens(self) -> np.ndarray:
        """max_new_tokens − generated, per position (finished requests included, with their final
        count, as SGLang's admission counts them)."""
        columns = self.columns
        remaining = columns.max_new[self.rows] - columns.n_out[self.rows]
        for i in np.flatnonzero(~self.live_mask()).tolist():
            req = self.req_array[i]
            remaining[i] = req.max_new_tokens - req.num_outputs
        return remaining


@dataclass(slots=True)
class ScheduledBatch:
    """What one plan asked the worker to do, kept until its result is applied (results come back in
    plan order; several plans may be in flight)."""

    kind: StepKind
    step_id: int
    # Requests extended in this step, in plan order (the chunked continuation first), with the serial
    # of each one's row tenancy and whether a token is sampled after its extend (not after a middle
    # chunk), and the handles introduced by this step (they get a NewSeq in the plan).
    extend_reqs: list[Request] = field(default_factory=list)
    extend_serials: list[int] = field(default_factory=list)
    extend_sampled: list[bool] = field(default_factory=list)
    new_handles: set[int] = field(default_factory=set)
    # Extend entries that score prompt rows: entry index -> the first row's position.
    score_starts: dict[int, int] = field(default_factory=dict)
    # Requests decoded in this step, in plan order, as RunningBatch's arrays, and each one's handle
    # and the slot its decode writes.
    decode_reqs: np.ndarray = field(default_factory=_no_objects)
    decode_rows: np.ndarray = field(default_factory=_no_ints)
    decode_serials: np.ndarray = field(default_factory=_no_ints)
    decode_handles: np.ndarray = field(default_factory=_no_ints)
    decode_slots: np.ndarray = field(default_factory=_no_ints)

    @property
    def is_extend(self) -> bool:
        return self.kind in (StepKind.PREFILL, StepKind.MIXED)

    @property
    def sampled_tokens(self) -> int:
        """Tokens the result carries: one per sampled extend, then one per decode."""
        return sum(self.extend_sampled) + len(self.decode_rows)

    def note_extend(self, serial: int, sampled: bool, introduced: int | None) -> None:
        """The next extend request's row tenancy, whether a token is sampled after it, and its handle
        when this step introduces it."""
        self.extend_serials.append(serial)
        self.extend_sampled.append(sampled)
        if introduced is not None:
            self.new_handles.add(introduced)

    def decode_from(self, running: RunningBatch, handles: np.ndarray, slots: np.ndarray) -> None:
        """The whole running batch is decoded in this step, into these slots; a prefill batch that
        also decodes is a mixed one (docs/scheduler.md#mixed-chunk)."""
        self.decode_reqs, self.decode_rows, self.decode_serials = (
            running.req_array,
            running.rows,
            running.serials,
        )
        self.decode_handles, self.decode_slots = handles, slots
        if self.extend_reqs:
            self.kind = StepKind.MIXED
