"""Per-sequence worker state, kept as rows of preallocated numpy arrays and updated by plan deltas.

Each live handle owns one row: its slot table (`slots[row, :lengths[row]]`, slot ids for positions
0..n-1), the token it sampled last (the input of its next decode) and its sampler parameters.
Columnar rows let a decode step gather inputs for the whole batch with a few fancy-index
operations instead of a Python loop over requests. Token history is kept (as Python lists) only
for sequences that use penalties.

Mutations happen only through the methods below; `live_seqs` and `seq_slots` are maintained
incrementally so the per-step KV report costs O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos.worker import SamplerParams

NO_TOKEN = -1
_INITIAL_ROWS = 64


class PlanError(Exception):
    """The plan contradicts the worker's state; the step is answered with this message as error."""


@dataclass(frozen=True, slots=True)
class SamplerColumns:
    """Sampler parameters for a batch of rows, one array entry per row."""

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    has_seed: np.ndarray
    seed: np.ndarray  # uint64; meaningful where has_seed
    logprobs: np.ndarray
    # SamplerParams.processed_logprobs per row (bool); None: no row reports processed logprobs.
    processed: np.ndarray | None = None


class SequenceTable:
    """Slot tables and sampling state for every sequence the worker knows."""

    def __init__(self, max_context: int) -> None:
        self.max_context = max_context
        self._row_of: dict[int, int] = {}
        self._free_rows: list[int] = []
        self._params: list[SamplerParams | None] = []
        self._history: dict[int, list[int]] = {}
        # Rows that bias logits: (token ids, biases), from SamplerParams.logit_bias.
        self._bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.slots = np.zeros((0, max_context), dtype=np.int64)
        self.lengths = np.zeros(0, dtype=np.int64)
        self.last_token = np.zeros(0, dtype=np.int64)
        self._sampler_cols = np.zeros((0, 7), dtype=np.float64)
        self._seeds = np.zeros(0, dtype=np.uint64)
        self.seq_slots = 0
        self._grow(_INITIAL_ROWS)

    # ---- membership --------------------------------------------------------------------------

    @property
    def live_seqs(self) -> int:
        return len(self._row_of)

    def __contains__(self, handle: int) -> bool:
        return handle in self._row_of

    def handles(self) -> list[int]:
        """Every live handle (in no particular order)."""
        return list(self._row_of)

    def row(self, handle: int) -> int:
        try:
            return self._row_of[handle]
        except KeyError:
            raise PlanError(f"unknown handle {handle}") from None

    def rows(self, handles: np.ndarray) -> np.ndarray:
        """Rows of `handles` (an int64 array); PlanError naming the first unknown one."""
        row_of = self._row_of
        try:
            return np.fromiter((row_of[h] for h in handles.tolist()), dtype=np.int64, count=len(handles))
        except KeyError as exc:
            raise PlanError(f"unknown handle {exc.args[0]}") from None

    def add(self, handle: int, params: SamplerParams, prefix_slots: np.ndarray, history: np.ndarray) -> None:
        """Start a sequence whose first len(prefix_slots) positions are already in the pool."""
        if handle in self._row_of:
            raise PlanError(f"handle {handle} is already live")
        if len(prefix_slots) > self.max_context:
            raise PlanError(f"handle {handle}: prefix of {len(prefix_slots)} exceeds max context")
        row = self._take_row()
        self._row_of[handle] = row
        self._params[row] = params
        self._set_slots(row, prefix_slots)
        self.last_token[row] = NO_TOKEN
        self._sampler_cols[row] = _sampler_row(params)
        self._seeds[row] = np.uint64(params.seed or 0)
        if params.uses_penalties:
            self._history[row] = [int(t) for t in history.tolist()]
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias, strict=True)
            self._bias[row] = (np.asarray(ids, dtype=np.int64), np.asarray(biases, dtype=np.float32))

    def remove(self, handle: int) -> None:
        """Forget a sequence (finished, aborted, retracted). Unknown handles are a PlanError."""
        row = self.row(handle)
        del self._row_of[handle]
        self.seq_slots -= int(self.lengths[row])
        self.lengths[row] = 0
        self._params[row] = None
        self._history.pop(row, None)
        self._bias.pop(row, None)
        self._free_rows.append(row)

    # ---- slot tables -------------------------------------------------------------------------

    def slot_table(self, handle: int) -> np.ndarray:
        row = self.row(handle)
        return self.slots[row, : self.lengths[row]].copy()

    def replace_slots(self, handle: int, slots: np.ndarray) -> None:
        """Make `slots` the whole slot table of `handle` (used by offload and restore)."""
        self._set_slots(self.row(handle), slots)

    def remap(self, handle: int, start: int, slots: np.ndarray) -> None:
        """Point positions [start, start + len(slots)) at other slots holding the same KV."""
        row = self.row(handle)
        end = start + len(slots)
        if start < 0 or end > self.lengths[row]:
            raise PlanError(
                f"handle {handle}: remap of [{start}, {end}) outside its {self.lengths[row]} slots"
            )
        self.slots[row, start:end] = slots

    def _set_slots(self, row: int, slots: np.ndarray) -> None:
        self.seq_slots += len(slots) - int(self.lengths[row])
        self.slots[row, : len(slots)] = slots
        self.lengths[row] = len(slots)

    def append_slots(self, rows: np.ndarray, counts: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Append counts[i] slots (consecutive in `slots`) to rows[i]; returns their positions.

        Rows must be distinct. Raises PlanError (before changing anything) past max context.
        """
        starts = self.lengths[rows]
        ends = starts + counts
        if len(ends) and int(ends.max()) > self.max_context:
            raise PlanError(f"a sequence would exceed max context {self.max_context}")
        positions = _ragged_positions(starts, counts)
        self.slots[np.repeat(rows, counts), positions] = slots
        self.lengths[rows] = ends
        self.seq_slots += int(counts.sum())
        return positions

    # ---- sampling state ----------------------------------------------------------------------

    def params(self, row: int) -> SamplerParams:
        params = self._params[row]
        assert params is not None, "row is not live"
        return params

    def sampler_columns(self, rows: np.ndarray) -> SamplerColumns:
        cols = self._sampler_cols[rows]
        return SamplerColumns(
            temperature=cols[:, 0],
            top_p=cols[:, 1],
            top_k=cols[:, 2].astype(np.int64),
            min_p=cols[:, 3],
            has_seed=cols[:, 4] > 0,
            seed=self._seeds[rows],
            logprobs=cols[:, 5].astype(np.int64),
            processed=cols[:, 6] > 0,
        )

    @property
    def any_penalties(self) -> bool:
        """Whether any live sequence samples with penalties (most steps: none)."""
        return bool(self._history)

    @property
    def any_bias(self) -> bool:
        """Whether any live sequence biases its logits (most steps: none)."""
        return bool(self._bias)

    def bias(self, row: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(token ids, biases) of a row with a logit bias; None for rows without."""
        return self._bias.get(row)

    def history(self, row: int) -> list[int] | None:
        """Token history of a row that uses penalties; None for rows that do not."""
        return self._history.get(row)

    def extend_history(self, rows: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        """Append tokens to the history of the rows that keep one (penalty users only)."""
        if not self._history:
            return
        offsets = np.concatenate(([0], np.cumsum(counts)))
        for i, row in enumerate(rows.tolist()):
            history = self._history.get(row)
            if history is not None:
                history.extend(tokens[offsets[i] : offsets[i + 1]].tolist())

    # ---- rows --------------------------------------------------------------------------------

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow(max(_INITIAL_ROWS, len(self.lengths)))
        return self._free_rows.pop()

    def _grow(self, extra: int) -> None:
        old = len(self.lengths)
        self.slots = _grown(self.slots, extra)
        self.lengths = _grown(self.lengths, extra)
        self.last_token = _grown(self.last_token, extra)
        self._sampler_cols = _grown(self._sampler_cols, extra)
        self._seeds = _grown(self._seeds, extra)
        self._params.extend([None] * extra)
        # Pop from the end, so hand out low rows first.
        self._free_rows.extend(range(old + extra - 1, old - 1, -1))


def _grown(array: np.ndarray, extra: int) -> np.ndarray:
    pad = np.zeros((extra, *array.shape[1:]), dtype=array.dtype)
    return np.concatenate((array, pad))


def _sampler_row(p: SamplerParams) -> list[float]:
    seeded, processed = 1.0 if p.seed is not None else 0.0, 1.0 if p.processed_logprobs else 0.0
    return [p.temperature, p.top_p, p.top_k, p.min_p, seeded, p.logprobs, processed]


def _ragged_positions(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Positions starts[i], starts[i]+1, ..., starts[i]+counts[i]-1 for every i, concatenated."""
    total = int(counts.sum())
    first_index = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + (np.arange(total) - first_index)
