"""The decode set as the worker link carries it: a delta against the previous decode plan.

Both ends of a link keep the decode set (handles in plan order, each one's slot) of the previous
plan that had decode work; it starts empty and is emptied by a `reset` plan. A decode plan at 1,024
running differs from the previous one by a few handles, and most sequences write to the slot after
their last one, so the plan carries only what changed (worker.proto, DecodeBatch):

- handles: the whole set (`full`), or the previous set without `left` and with `joined` appended;
- slots: an entry whose handle was in the previous set defaults to its previous slot + 1; runs
  (entry, first slot, length) give consecutive entries consecutive explicit slots, and cover at
  least every entry that was not in the previous set.

`encode` and `decode` are pure: they return the new set, which the caller keeps once the whole plan
has been encoded or decoded (a plan that fails halfway leaves the link's state as it was). All the
work is vectorised numpy: no Python work per entry, only per run and per changed handle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protos.arrays import SortedIndex, WireError, check_range
from protos.stepwise.v1 import worker_pb2 as wk_pb

_MAX_SLOT = (1 << 63) - 1


def _i64(values: object = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class DecodeSet:
    """One plan's decode work: distinct handles in plan order and their slots (both int64)."""

    handles: np.ndarray
    slots: np.ndarray
    index: SortedIndex

    @classmethod
    def of(cls, handles: np.ndarray, slots: np.ndarray) -> DecodeSet:
        """A copy of the columns (callers may reuse theirs); WireError when a handle repeats or the
        columns differ in length."""
        return cls._owning(np.asarray(handles).astype(np.int64), np.asarray(slots).astype(np.int64))

    @classmethod
    def _owning(
        cls, handles: np.ndarray, slots: np.ndarray, repeated: str = "appears more than once"
    ) -> DecodeSet:
        """A set over these very arrays (int64), which nobody else may change; `repeated`
        says what a repeated handle means (the WireError's wording)."""
        if len(handles) != len(slots):
            raise WireError(f"decodes: {len(handles)} handles but {len(slots)} slots")
        index = SortedIndex(handles)
        if index.duplicate is not None:
            raise WireError(f"decodes: handle {index.duplicate} {repeated}")
        return cls(handles, slots, index)

    def __len__(self) -> int:
        return len(self.handles)


EMPTY = DecodeSet.of(_i64(), _i64())


@dataclass(frozen=True, slots=True)
class DecodeDelta:
    """The fields of a DecodeBatch, as int64 arrays (handles are uint64 on the wire, protos/worker.py)."""

    count: int = 0
    full: np.ndarray = field(default_factory=_i64)
    left: np.ndarray = field(default_factory=_i64)
    joined: np.ndarray = field(default_factory=_i64)
    run_entries: np.ndarray = field(default_factory=_i64)
    run_slots: np.ndarray = field(default_factory=_i64)
    run_lens: np.ndarray = field(default_factory=_i64)


NO_DECODES = DecodeDelta()


# --- encoding --------------------------------------------------------------------------------------


def encode(
    prev: DecodeSet,
    handles: np.ndarray,
    slots: np.ndarray,
    leaving: np.ndarray | None = None,
    allow_delta: bool = True,
) -> tuple[DecodeDelta, DecodeSet]:
    """This plan's decode work relative to `prev`, and the set to diff the next plan against.

    The handles go as a delta when that names fewer of them than the whole set (and `allow_delta`),
    else in full; slots are explicit only where the default is wrong. `leaving` (handles released or
    offloaded since `prev`) is a hint: when the set lost exactly those, order kept, and gained others
    at its end, no entry-by-entry lookup is needed. WireError (a bug of the caller's) when a handle
    repeats; `prev` is never changed.
    """
    if not len(handles):
        return NO_DECODES, prev
    handles, slots = np.asarray(handles).astype(np.int64), np.asarray(slots).astype(np.int64)
    split: tuple[np.ndarray, np.ndarray] | None
    if len(handles) == len(prev) and np.array_equal(handles, prev.handles):
        new = DecodeSet(prev.handles, slots, prev.index)
        defaults, split = prev.slots + 1, (EMPTY.handles, EMPTY.handles)
    else:
        new = DecodeSet._owning(handles, slots)
        defaults, split = _align(prev, new, leaving)
    entries, firsts, lens = _runs(slots != defaults, slots)
    if not allow_delta or split is None or len(split[0]) + len(split[1]) >= len(new):
        return DecodeDelta(len(new), new.handles, EMPTY.handles, EMPTY.handles, entries, firsts, lens), new
    return DecodeDelta(len(new), EMPTY.handles, split[0], split[1], entries, firsts, lens), new


def _align(
    prev: DecodeSet, new: DecodeSet, leaving: np.ndarray | None
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """Each entry's default slot, and (left, joined) when `new` is `prev` without some handles,
    order kept, with the others appended (None otherwise)."""
    kept = None if leaving is None else _kept_if_only(prev, new, leaving.astype(np.int64, copy=False))
    if kept is not None:
        carried = kept.nonzero()[0]
        split = (prev.handles[~kept], new.handles[len(carried) :])
        return _carried_defaults(prev, carried, len(split[1])), split
    at_prev = prev.index.positions(new.handles)
    defaults = _defaults_at(prev, at_prev)
    k = int(np.count_nonzero(at_prev >= 0))
    if (k and int(at_prev[:k].min()) < 0) or (k > 1 and not (at_prev[1:k] > at_prev[: k - 1]).all()):
        return defaults, None  # not a prefix of `prev`'s members in their order: a reorder
    kept = np.zeros(len(prev), dtype=bool)
    kept[at_prev[:k]] = True
    return defaults, (prev.handles[~kept], new.handles[k:])


def _kept_if_only(prev: DecodeSet, new: DecodeSet, leaving: np.ndarray) -> np.ndarray | None:
    """The mask of `prev`'s members that stay, if exactly the members of `leaving` left (order kept)
    and the rest of `new` is new: checked with one compare and a lookup of the tail, not of every
    entry. None when that is not what happened."""
    at = prev.index.positions(leaving)
    kept = np.ones(len(prev), dtype=bool)
    kept[at[at >= 0]] = False
    carried = prev.handles[kept]
    k = len(carried)
    if k > len(new) or not np.array_equal(new.handles[:k], carried):
        return None
    # `new` has no repeats, so a joined handle that was in `prev` can only be one that left.
    if _meet(new.handles[k:], prev.handles[~kept]):
        return None
    return kept


def _meet(few: np.ndarray, others: np.ndarray) -> bool:
    """Whether two short arrays share a value (one broadcast compare; a sort when they are long)."""
    if not len(few) or not len(others):
        return False
    if len(few) * len(others) <= 1 << 14:
        return bool((few[:, None] == others[None, :]).any())
    return bool(np.isin(few, others).any())


def _defaults_at(prev: DecodeSet, at_prev: np.ndarray) -> np.ndarray:
    """Default slots of entries at these positions of `prev` (-1: not in it, so no default)."""
    if not len(prev):
        return np.full(len(at_prev), -1, dtype=np.int64)
    return np.where(at_prev >= 0, prev.slots[at_prev] + 1, -1)


def _carried_defaults(prev: DecodeSet, carried: np.ndarray, joined: int) -> np.ndarray:
    """Default slots of a set that is `prev`'s rows `carried`, in order, then `joined` new ones."""
    return np.concatenate((prev.slots[carried] + 1, np.full(joined, -1, dtype=np.int64)))


def _runs(explicit: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of explicit entries with consecutive slots: (first entry, first slot, length)."""
    at = explicit.nonzero()[0]
    if not len(at):
        return EMPTY.slots, EMPTY.slots, EMPTY.slots
    chosen = slots[at]
    breaks = ((at[1:] - at[:-1]) != 1) | ((chosen[1:] - chosen[:-1]) != 1)
    starts = np.concatenate(([0], breaks.nonzero()[0] + 1))
    lens = np.concatenate((starts[1:], [len(at)])) - starts
    return at[starts], chosen[starts], lens


# --- decoding --------------------------------------------------------------------------------------


def decode(prev: DecodeSet, delta: DecodeDelta) -> DecodeSet | None:
    """This plan's decode set from `prev` and the plan's delta; None when the plan has no decode
    work (then `prev` stays the set to diff against). WireError, naming the field, for a delta that
    cannot apply to `prev`."""
    if delta.count == 0:
        _check_no_decodes(delta)
        return None
    if delta.count < 0:
        raise WireError(f"decodes.count: {delta.count} is negative")
    handles, slots, needs_run = _decoded_handles(prev, delta)
    if len(handles) != delta.count:
        raise WireError(f"decodes: the delta makes {len(handles)} entries, count says {delta.count}")
    covered = _apply_runs(slots, delta)
    if needs_run is not None:
        missing = (needs_run & ~covered).nonzero()[0]
        if len(missing):
            i = int(missing[0])
            raise WireError(
                f"decodes: entry {i} (handle {handles[i]}) joined the set but no run gives its slot"
            )
    if handles is prev.handles:
        return DecodeSet(handles, slots, prev.index)  # same members: the index still holds
    if len(delta.full):
        return DecodeSet._owning(handles, slots)
    # Carried members are distinct: a repeat is a joined handle that is still in the set.
    return DecodeSet._owning(handles, slots, "is in decodes.joined but already in the set")


def _check_no_decodes(delta: DecodeDelta) -> None:
    fields = ("full", "left", "joined", "run_entries", "run_slots", "run_lens")
    for name in fields:
        if len(getattr(delta, name)):
            raise WireError(f"decodes.{name}: not empty although count is 0")


def _decoded_handles(prev: DecodeSet, delta: DecodeDelta) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The set's handles, their default slots, and the mask of entries a run must cover (the ones
    not in `prev`; None when there are none)."""
    if len(delta.full):
        if len(delta.left) or len(delta.joined):
            raise WireError("decodes: full and left/joined at once")
        at_prev = prev.index.positions(delta.full)
        return delta.full, _defaults_at(prev, at_prev), at_prev < 0
    if not len(delta.left) and not len(delta.joined):
        return prev.handles, prev.slots + 1, None
    carried = _carried_rows(prev, delta)
    handles = np.concatenate((prev.handles[carried], delta.joined))
    needs_run = np.zeros(len(handles), dtype=bool)
    needs_run[len(carried) :] = True
    return handles, _carried_defaults(prev, carried, len(delta.joined)), needs_run


def _carried_rows(prev: DecodeSet, delta: DecodeDelta) -> np.ndarray:
    """Rows of `prev` that stay: all but `left` (members, once each); `joined` must be new."""
    at_left = prev.index.positions(delta.left)
    if len(at_left) and int(at_left.min()) < 0:
        raise WireError(f"decodes.left: handle {delta.left[np.argmin(at_left)]} is not in the decode set")
    kept = np.ones(len(prev), dtype=bool)
    kept[at_left] = False
    carried = kept.nonzero()[0]
    if len(prev) - len(carried) != len(at_left):
        raise WireError("decodes.left: a handle appears more than once")
    # A joined handle that stayed shows up as a repeat of the new set (decode); one that left, here.
    if _meet(delta.joined, delta.left):
        raise WireError("decodes.joined: names a handle that decodes.left takes out of the set")
    return carried


def _apply_runs(slots: np.ndarray, delta: DecodeDelta) -> np.ndarray:
    """Write the runs' slots into `slots`; the mask of the entries they cover."""
    entries, firsts, lens = delta.run_entries, delta.run_slots, delta.run_lens
    if not len(entries) == len(firsts) == len(lens):
        raise WireError(f"decodes: runs of {len(entries)} entries, {len(firsts)} slots, {len(lens)} lens")
    covered = np.zeros(len(slots), dtype=bool)
    if not len(entries):
        return covered
    _check_runs(entries, firsts, lens, len(slots))
    if len(entries) == 1:  # the common page-size-1 case: one block
        first, n = int(entries[0]), int(lens[0])
        slots[first : first + n] = np.arange(int(firsts[0]), int(firsts[0]) + n)
        covered[first : first + n] = True
        return covered
    offsets = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    at = np.repeat(entries, lens) + offsets
    slots[at] = np.repeat(firsts, lens) + offsets
    covered[at] = True
    return covered


def _check_runs(entries: np.ndarray, firsts: np.ndarray, lens: np.ndarray, count: int) -> None:
    """Runs of at least one entry each, in entry order, not overlapping, within the set, and with
    slots that neither go negative nor overflow."""
    if int(lens.min()) < 1:
        raise WireError(f"decodes.run_lens: value {int(lens.min())} is outside [1, {count + 1})")
    if not 0 <= int(entries[0]) < count:
        raise WireError(f"decodes.run_entries: value {int(entries[0])} is outside [0, {count})")
    check_range(firsts, "decodes.run_slots", 0, _MAX_SLOT - count)
    ends = entries + lens
    # With every length >= 1, this also keeps every entry in [0, count) and in increasing order.
    if int(ends[-1]) > count or not (entries[1:] >= ends[:-1]).all():
        raise WireError("decodes: runs overlap, are out of order, or pass the last entry")


# --- protobuf --------------------------------------------------------------------------------------


def fill(msg: wk_pb.DecodeBatch, delta: DecodeDelta) -> None:
    """Write `delta` into an empty DecodeBatch (in place: no copy of the message)."""
    msg.count = delta.count
    for name in ("full", "left", "joined", "run_entries", "run_slots", "run_lens"):
        values = getattr(delta, name)
        if len(values):
            getattr(msg, name).extend(values.tolist())


def from_proto(msg: wk_pb.DecodeBatch) -> DecodeDelta:
    return DecodeDelta(
        count=msg.count,
        full=_handles(msg.full, "full"),
        left=_handles(msg.left, "left"),
        joined=_handles(msg.joined, "joined"),
        run_entries=_array(msg.run_entries, EMPTY.slots),
        run_slots=_array(msg.run_slots, EMPTY.slots),
        run_lens=_array(msg.run_lens, EMPTY.slots),
    )


def _handles(values: object, name: str) -> np.ndarray:
    """A uint64 field of handles as int64 (protos/worker.py); WireError for one past 2^63 - 1."""
    try:
        return _array(values, EMPTY.handles)
    except OverflowError:
        raise WireError(f"decodes.{name}: a handle is past 2^63 - 1") from None


def _array(values: object, empty: np.ndarray) -> np.ndarray:
    """A repeated field as an array of `empty`'s dtype (most fields of most plans are empty)."""
    n = len(values)  # type: ignore[arg-type]
    return np.fromiter(values, dtype=empty.dtype, count=n) if n else empty  # type: ignore[call-overload]
