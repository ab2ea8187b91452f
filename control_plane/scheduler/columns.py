"""Per-row state of the requests that hold a request row, as numpy columns (the step's hot path).

A request holds a row (`req_pool_idx`, SGLang's req_to_token_pool row) from its first extend until it
finishes, is aborted, retracted or preempted: the running batch, the chunked request, and requests
whose prefill is in flight. The rule:

* While a request holds a row, the columns are authoritative for its KV lengths (`committed`,
  `allocated`), its generated-token count (`n_out`) and the tokens applied since its last sync (the
  `tokens` table). `Request.kv_committed_len`, `kv_allocated_len` and `num_outputs` read (and the
  first two write) the columns; `Request.output_ids` and `fill_ids` (so every prefix match and cache
  operation) first sync: the pending tokens are appended to the request's int64 fill array. Result
  application and decode planning touch only the columns; whatever reads a running request through
  the Request (retraction order, the ratio estimate, preemption, caching a finished request,
  failover) therefore sees synced values, with nothing to call first.
* `detach` (when the row is released) syncs the request and copies its lengths back: from then on its
  own fields are authoritative again.

Every tenancy of a row gets a fresh `serial`, 0 when the row is free. A plan in flight remembers the
serial of each row it named, so applying its result later can tell whether the row still belongs to
the request it was planned for: the request may have finished, been aborted or retracted, and the
row reused, in between (overlap scheduling, docs/scheduler.md#overlap).

A sync copies bytes (no Python object per token: a Python int is made only if `output_ids` is read).
So that the table stays small, each `append` also syncs a few rows in turn: every row at least once
per SYNC_INTERVAL appends, which bounds the table's width and spreads the copying over the steps.
"""

from __future__ import annotations

import numpy as np

from control_plane.request import Request

# Every row is synced at least once per this many appends: the table is at most rows × this × 4 bytes.
SYNC_INTERVAL = 256
_MIN_WIDTH = 16


class RowColumns:
    """Columns indexed by request row; `attach`/`detach` bracket a request's tenancy of its row."""

    def __init__(self, rows: int) -> None:
        self.serial = np.zeros(rows, dtype=np.int64)
        self.committed = np.zeros(rows, dtype=np.int64)
        self.allocated = np.zeros(rows, dtype=np.int64)
        self.n_out = np.zeros(rows, dtype=np.int64)
        self.n_pending = np.zeros(rows, dtype=np.int64)
        self.max_new = np.zeros(rows, dtype=np.int64)
        self.min_new = np.zeros(rows, dtype=np.int64)
        self.ignore_eos = np.zeros(rows, dtype=bool)
        # Whether the request has its own stop token ids (rare: checked in Python, row by row).
        self.has_stop = np.zeros(rows, dtype=bool)
        # The request was aborted while running (Request.to_finish): its next token ends it, unstreamed.
        self.aborting = np.zeros(rows, dtype=bool)
        self.uid = np.zeros(rows, dtype=np.uint64)
        self.handle = np.full(rows, -1, dtype=np.int64)
        self.reqs = np.full(rows, None, dtype=object)
        self.tokens = np.zeros((rows, 0), dtype=np.int32)
        self._next_serial = 1
        # An upper bound on n_pending.max(), kept without a pass over the rows.
        self._pending_bound = 0
        # The next rows the rolling sync visits start here.
        self._sync_cursor = 0

    # --- tenancy -----------------------------------------------------------------------------------

    def attach(self, req: Request) -> None:
        """Mutates: `req` (holding row req.req_pool_idx) now keeps its per-step state here."""
        row = req.req_pool_idx
        self.committed[row] = req.kv_committed_len
        self.allocated[row] = req.kv_allocated_len
        self.n_out[row] = req.num_outputs
        self.n_pending[row] = 0
        self.max_new[row] = req.max_new_tokens
        self.min_new[row] = req.min_new_tokens
        self.ignore_eos[row] = req.params.ignore_eos
        self.has_stop[row] = bool(req.params.stop_token_ids)
        self.aborting[row] = req.to_finish is not None
        self.uid[row] = req.uid
        self.handle[row] = req.handle
        self.reqs[row] = req
        self.serial[row] = self._next_serial
        self._next_serial += 1
        req.bind_columns(self)

    def detach(self, req: Request) -> None:
        """Mutates: sync `req`, hand its lengths back to it, and free its row's columns."""
        row = req.req_pool_idx
        self.sync(req)
        committed, allocated = int(self.committed[row]), int(self.allocated[row])
        req.bind_columns(None)
        req.kv_committed_len, req.kv_allocated_len = committed, allocated
        self.serial[row] = 0
        self.reqs[row] = None

    def set_handle(self, req: Request) -> None:
        """Mutates: the handle the request got at its first extend (after its row was attached)."""
        self.handle[req.req_pool_idx] = req.handle

    def mark_aborting(self, req: Request) -> None:
        """Mutates: the request's next token ends it (an abort that waits for it,
        docs/scheduler.md#aborts)."""
        self.aborting[req.req_pool_idx] = True

    def holds(self, req: Request, serial: int) -> bool:
        """Whether `req` still holds the row tenancy `serial` was taken for."""
        row = req.req_pool_idx
        return row >= 0 and int(self.serial[row]) == serial

    # --- lengths -----------------------------------------------------------------------------------

    def allocate_decode(self, rows: np.ndarray, seq_lens: np.ndarray) -> None:
        """Mutates: each row got a slot for position seq_len (its next decode)."""
        self.allocated[rows] = seq_lens + 1

    def commit_decode(self, rows: np.ndarray) -> None:
        """Mutates: each row's decode wrote its input token's KV."""
        self.committed[rows] += 1

    # --- tokens --------------------------------------------------------------------------------------

    def append(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Mutates: one more generated token for each (distinct) row; syncs the next rows in turn."""
        self._sync_next_rows()
        bound = self._pending_bound + 1
        if bound > self.tokens.shape[1]:
            bound = self._make_room()
        self.tokens[rows, self.n_pending[rows]] = tokens
        self.n_pending[rows] += 1
        self.n_out[rows] += 1
        self._pending_bound = bound

    def append_one(self, req: Request, token: int) -> None:
        self.append(np.array([req.req_pool_idx]), np.array([token], dtype=np.int32))

    def sync(self, req: Request) -> None:
        """Mutates: move `req`'s pending tokens into the request (its fill array)."""
        row = req.req_pool_idx
        pending = int(self.n_pending[row])
        if pending:
            self.n_pending[row] = 0
            req.extend_output(self.tokens[row, :pending])

    def sync_all(self) -> None:
        self._sync_rows(np.flatnonzero(self.n_pending))
        self._pending_bound = 0

    def _sync_rows(self, rows: np.ndarray) -> None:
        for row in rows.tolist():
            self.sync(self.reqs[row])

    def _sync_next_rows(self) -> None:
        """The rolling sync: the next ceil(rows / SYNC_INTERVAL) rows, so that every row is visited
        at least once per SYNC_INTERVAL appends."""
        start, total = self._sync_cursor, len(self.serial)
        stop = min(start - (-total // SYNC_INTERVAL), total)
        self._sync_rows(start + np.flatnonzero(self.n_pending[start:stop]))
        self._sync_cursor = stop if stop < total else 0

    def _make_room(self) -> int:
        """Make every row able to take one more token; returns the new bound on n_pending.max()
        (at most SYNC_INTERVAL, thanks to the rolling sync)."""
        needed = int(self.n_pending.max(initial=0)) + 1
        width = self.tokens.shape[1]
        if needed > width:
            size = min(SYNC_INTERVAL, max(2 * width, needed, _MIN_WIDTH))
            grown = np.zeros((len(self.tokens), size), dtype=np.int32)
            grown[:, :width] = self.tokens
            self.tokens = grown
        return needed
