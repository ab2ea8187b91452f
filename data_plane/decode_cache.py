"""A contiguous copy of the current decode set's K/V, so a decode step need not gather from the pool.

The general attention path gathers every sequence's keys and values from the paged pool into
[B, Lmax] for every layer and every step. In steady decoding the batch is the same sequences in
the same order, each one token longer than last step, so the gathered block only grows by one
column per row. The DecodeCache keeps that block per layer ([layers, rows, Hkv, Lcap, D], the
layout attention reads without a stride penalty), one row per sequence, and each step copies only
the new token's K/V into it (from the pool, right after the pool write). A row is loaded from the
pool (one gather per layer for all such rows) when its sequence joins, its length moved by
anything but +1, the block grew, or the executor invalidated the cache (remaps, restores,
offloads, releases, reset); a reorder only permutes the queries. The pool stays the source of truth:
the cache only ever copies from it, so shared prefix slots and any page size are honoured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# The block grows in steps of this many positions and rows, and never shrinks, so joins, leaves
# and longer sequences rarely reallocate (a fresh block is zero-filled, which is not free).
_CAPACITY_STEP = 128
_ROWS_STEP = 16


@dataclass(frozen=True, slots=True)
class DecodeView:
    """What one decode step's attention reads from the cache (one query per decode entry).

    Attention runs over block rows [0, rows_used): the entries' rows plus idle ones (a sequence
    that left and whose row was not reused yet), which see key 0 only and whose output is dropped.
    """

    k: torch.Tensor  # [layers, rows, num_kv_heads, capacity, head_dim]
    v: torch.Tensor
    rows_used: int
    max_keys: int
    # [batch] block row of each decode entry; None when entry b sits in row b and rows_used == batch.
    query_rows: torch.Tensor | None
    # [batch * num_kv_heads] flat index (row * Hkv + h) * capacity + kv_len - 1 of this step's token
    # in a layer's [rows * Hkv * capacity, head_dim] buffer.
    write_index: torch.Tensor
    # [batch] pool slot of this step's token, whose K/V is copied in after the pool write.
    token_slots: torch.Tensor
    # Rows to (re)load from the pool with one gather, and their [n, max_len] pool slots; None: none.
    load_rows: torch.Tensor | None
    load_slots: torch.Tensor | None
    # [rows_used, 1, 1, max_keys] additive length mask; None when every row has max_keys keys.
    mask: torch.Tensor | None
    # Like `mask` and also hiding keys outside the window; None without a window (or nothing hidden).
    window_mask: torch.Tensor | None

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values as [rows_used, num_kv_heads, max_keys, head_dim] views."""
        used = (index, slice(0, self.rows_used), slice(None), slice(0, self.max_keys))
        return self.k[used], self.v[used]

    def update(self, index: int, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
        """Bring layer `index`'s block up to date with the pool (which holds this step's K/V)."""
        k_buf, v_buf = self.k[index], self.v[index]
        head_dim = k_buf.shape[-1]
        for buf, pool in ((k_buf, k_pool), (v_buf, v_pool)):
            if self.load_rows is not None and self.load_slots is not None:
                n, width = self.load_slots.shape
                loaded = pool.index_select(0, self.load_slots.reshape(-1)).view(n, width, *pool.shape[1:])
                buf[self.load_rows, :, :width] = loaded.transpose(1, 2)
            new = pool.index_select(0, self.token_slots).view(-1, head_dim)
            buf.view(-1, head_dim).index_copy_(0, self.write_index, new)


class DecodeCache:
    """Per-layer K/V of the recent decode set, one block row per sequence. Not thread-safe.

    A sequence keeps its row while it decodes every step, so reorders cost nothing and a join or a
    leave loads (one gather) only the rows that changed. A sequence that misses a step loses its
    row; rows are compacted (reloaded in decode order) when idle rows pile up.
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self._shape = (num_layers, num_kv_heads, head_dim)
        self._dtype, self._device = dtype, device
        self._k = torch.zeros(0, 0, 0, 0, 0)
        self._v = torch.zeros(0, 0, 0, 0, 0)
        self._row_of: dict[int, int] = {}  # handle -> block row
        self._row_len = np.zeros(0, dtype=np.int64)  # kv length each row holds; 0: free

    @property
    def nbytes(self) -> int:
        """Device bytes the block holds (it grows with the decode set and its longest sequence)."""
        return 2 * self._k.numel() * self._k.element_size()

    def forget(self, handles: list[int]) -> None:
        """Drop these sequences' rows (released, remapped, moved to or from the host pool)."""
        for handle in handles:
            row = self._row_of.pop(handle, None)
            if row is not None:
                self._row_len[row] = 0

    def invalidate(self) -> None:
        """Forget every row: the next step reloads the whole decode set from the pool."""
        self._row_of.clear()
        self._row_len[:] = 0

    def step(
        self,
        handles: np.ndarray,
        kv_lens: np.ndarray,
        slot_table: np.ndarray,
        rows: np.ndarray,
        token_slots: np.ndarray,
        sliding_window: int | None,
    ) -> DecodeView:
        """The view for a decode step over `handles` (kv_lens already count this step's token).

        `slot_table[rows[b], :kv_lens[b]]` are sequence b's slots; read only to load its row.
        """
        batch, max_keys = len(handles), int(kv_lens.max())
        if self._k.shape[1] < batch or self._k.shape[3] < max_keys:
            self._grow(batch, max_keys)
        block_rows, load = self._place(handles.tolist(), kv_lens)
        rows_used = int(block_rows.max()) + 1
        if rows_used > batch + batch // 4 + 1:  # too many idle rows: compact
            self.invalidate()
            block_rows, load = self._place(handles.tolist(), kv_lens)
            rows_used = batch
        self._row_len[block_rows] = kv_lens
        identity = rows_used == batch and bool((block_rows == np.arange(batch)).all())
        kv_heads, capacity = self._k.shape[2], self._k.shape[3]
        heads = block_rows[:, None] * kv_heads + np.arange(kv_heads)[None, :]
        row_lens = np.maximum(self._row_len[:rows_used], 1)  # idle rows see key 0
        mask, window_mask = _length_masks(row_lens, max_keys, sliding_window, self._dtype, self._device)
        load_rows = load_slots = None
        if len(load):
            width = int(kv_lens[load].max())
            slot_rows = slot_table[rows[load], :width]
            padded = np.where(np.arange(width)[None, :] < kv_lens[load][:, None], slot_rows, slot_rows[:, :1])
            load_rows, load_slots = self._tensor(block_rows[load]), self._tensor(padded)
        return DecodeView(
            k=self._k,
            v=self._v,
            rows_used=rows_used,
            max_keys=max_keys,
            query_rows=None if identity else self._tensor(block_rows),
            write_index=self._tensor((heads * capacity + (kv_lens - 1)[:, None]).reshape(-1)),
            token_slots=self._tensor(token_slots),
            load_rows=load_rows,
            load_slots=load_slots,
            mask=mask,
            window_mask=window_mask,
        )

    def _place(self, handles: list[int], kv_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Block row of each entry, and the entries whose row must be loaded from the pool."""
        present = set(handles)
        for handle in [h for h in self._row_of if h not in present]:
            self._row_len[self._row_of.pop(handle)] = 0
        free = iter(np.flatnonzero(self._row_len == 0).tolist())
        block_rows = np.empty(len(handles), dtype=np.int64)
        load = []
        for i, handle in enumerate(handles):
            row = self._row_of.get(handle)
            if row is None:
                row = next(free)  # rows of live handles have a length, so are never free
                self._row_of[handle] = row
                load.append(i)
            elif self._row_len[row] != kv_lens[i] - 1:
                load.append(i)
            block_rows[i] = row
        return block_rows, np.array(load, dtype=np.int64)

    def _grow(self, batch: int, max_keys: int) -> None:
        """A block of >= `batch` rows and >= `max_keys` positions (zeros: never NaN); rows reload."""
        layers, kv_heads, head_dim = self._shape
        rows = max(self._k.shape[1], _round_up(batch, _ROWS_STEP))
        capacity = max(self._k.shape[3], _round_up(max_keys, _CAPACITY_STEP))
        shape = (layers, rows, kv_heads, capacity, head_dim)
        self._k = torch.zeros(shape, dtype=self._dtype, device=self._device)
        self._v = torch.zeros(shape, dtype=self._dtype, device=self._device)
        self._row_of.clear()
        self._row_len = np.zeros(rows, dtype=np.int64)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self._device)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _length_masks(
    kv_lens: np.ndarray, max_keys: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Additive [B, 1, 1, max_keys] masks for one query per row at position kv_len - 1."""
    key_ids = np.arange(max_keys)[None, :]
    allowed = key_ids < kv_lens[:, None]
    mask = None if bool(allowed.all()) else _additive(allowed, dtype, device)
    if window is None:
        return mask, None
    allowed &= key_ids > kv_lens[:, None] - 1 - window
    return mask, None if bool(allowed.all()) else _additive(allowed, dtype, device)


def _additive(allowed: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mask = torch.zeros((allowed.shape[0], 1, 1, allowed.shape[1]), dtype=dtype, device=device)
    return mask.masked_fill_(~torch.from_numpy(allowed[:, None, None, :]).to(device), float("-inf"))
