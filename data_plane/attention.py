"""Attention over the paged KV pool for a ragged batch, without a Python loop over sequences.

A step's tokens are laid out flat (extend tokens of every entry, then one token per decode). For
attention they are split into groups (extends, decodes) so that one long prompt does not pad a
batch of single-token decodes. Inside a group, queries are scattered into a padded
[B, Qmax] layout, each sequence's keys are gathered from the pool by its slot table into
[B, Lmax], and one `scaled_dot_product_attention` call (GQA-aware) does the work. The slot table
lists slots in position order, so "causal" is simply key index <= query position; which slot ids
arrive (page size 1, 4, 16, scrambled) does not matter to the gather. Sliding-window layers
(Mistral, some Qwen layers) use a second mask that also hides keys older than the window; the
gather stays the same, so one group serves both kinds of layer.

A pure decode group can instead be a DecodeGroup: its keys and values come from the DecodeCache
(a contiguous per-layer copy of the decode set's K/V that grows by one position per step), and
its mask is a length mask only, or none when every row has the same length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from data_plane.decode_cache import DecodeView


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Index tensors for one padded attention call over flat tokens [token_start, token_start+count)."""

    token_start: int
    token_count: int
    batch: int
    max_queries: int
    # [count] position of each flat token in the row-major padded [batch * max_queries] layout.
    pad_index: torch.Tensor
    # [batch, max_keys] pool slot of each key; padding repeats the row's first slot (always written).
    key_slots: torch.Tensor
    # [batch, 1, max_queries, max_keys] additive: 0 where the query may attend to the key, -inf elsewhere.
    # (An additive mask in the model dtype is about twice as fast as a bool mask in CPU SDPA.)
    mask: torch.Tensor
    # Like `mask`, and also -inf for keys at or before query position - window; None without a window.
    window_mask: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """One query per sequence over flat tokens [token_start, token_start+count), read from a DecodeView."""

    token_start: int
    token_count: int
    view: DecodeView


def build_group(
    token_start: int,
    q_lens: np.ndarray,
    kv_lens: np.ndarray,
    slot_rows: np.ndarray,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
) -> AttentionGroup:
    """Describe one attention group.

    `q_lens[b]` new tokens of sequence b sit at positions kv_lens[b]-q_lens[b] .. kv_lens[b]-1 and
    are contiguous in the flat layout starting at `token_start`; `slot_rows[b, :kv_lens[b]]` are
    its slots (already including the new tokens'). Requires every q_len >= 1. With a
    `sliding_window` w the group also carries `window_mask`, where a query at position p sees keys
    p - w + 1 .. p (transformers' sliding_window_overlay).
    """
    batch = len(q_lens)
    max_queries = int(q_lens.max())
    max_keys = int(kv_lens.max())
    query_ids = np.arange(max_queries)[None, :]
    valid = query_ids < q_lens[:, None]
    # Padded queries sit at position 0: they see key 0 only, never a NaN row; their output is dropped.
    q_pos = np.where(valid, (kv_lens - q_lens)[:, None] + query_ids, 0)
    allowed = np.arange(max_keys)[None, None, :] <= q_pos[:, :, None]
    key_ids = np.arange(max_keys)[None, :]
    key_slots = np.where(key_ids < kv_lens[:, None], slot_rows[:, :max_keys], slot_rows[:, :1])
    window_mask = None
    if sliding_window is not None:
        recent = np.arange(max_keys)[None, None, :] > q_pos[:, :, None] - sliding_window
        window_mask = _additive_mask((allowed & recent)[:, None], device, dtype)
    return AttentionGroup(
        token_start=token_start,
        token_count=int(q_lens.sum()),
        batch=batch,
        max_queries=max_queries,
        pad_index=torch.from_numpy(np.flatnonzero(valid)).to(device),
        key_slots=torch.from_numpy(key_slots.astype(np.int64)).to(device),
        mask=_additive_mask(allowed[:, None], device, dtype),
        window_mask=window_mask,
    )


def _additive_mask(allowed: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~torch.from_numpy(allowed).to(device), float("-inf"))


def _gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool[slots] for a 2-D slot matrix; index_select is ~4x faster than advanced indexing on CPU."""
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, *pool.shape[1:])


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    sliding: bool = False,
) -> torch.Tensor:
    """Attention output [token_count, num_heads * head_dim] for the group's tokens.

    `q` is [token_count, num_heads, head_dim] (already rotated); `k_pool`/`v_pool` are one layer's
    [capacity, num_kv_heads, head_dim] and must already hold this step's keys and values.
    `sliding` selects the group's window mask (which must then exist).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    # A decode group (one query each) or equal-length extends has no padding: skip scatter and gather.
    unpadded = group.token_count == group.batch * group.max_queries
    padded = q if unpadded else q.new_zeros(group.batch * group.max_queries, num_heads, head_dim)
    if not unpadded:
        padded[group.pad_index] = q
    queries = padded.view(group.batch, group.max_queries, num_heads, head_dim).transpose(1, 2)
    keys = _gather(k_pool, group.key_slots).transpose(1, 2)
    values = _gather(v_pool, group.key_slots).transpose(1, 2)
    mask = group.window_mask if sliding else group.mask
    assert mask is not None, "sliding layer but the group was built without a window"
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    flat = out.transpose(1, 2).reshape(group.batch * group.max_queries, num_heads * head_dim)
    return flat if unpadded else flat[group.pad_index]


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    group: DecodeGroup,
    layer: int,
    scale: float,
    sliding: bool = False,
) -> torch.Tensor:
    """Like paged_attention for a decode group: [batch, num_heads * head_dim].

    `k_pool`/`v_pool` are layer `layer`'s pool tensors and must already hold this step's K/V; the
    view's block for that layer is brought up to date from them first.
    """
    view = group.view
    view.update(layer, k_pool, v_pool)
    keys, values = view.layer(layer)
    num_heads, head_dim = q.shape[1], q.shape[2]
    rows = q
    if view.query_rows is not None:  # entries sit in other block rows (reordered, or idle rows between)
        rows = q.new_zeros(view.rows_used, num_heads, head_dim).index_copy_(0, view.query_rows, q)
    # Query head h reads kv head h // group, so the heads of one kv head form a [group] query axis:
    # plain (non-GQA) attention over [rows, kv_heads, group] queries, no key repeat, no copy.
    queries = rows.view(view.rows_used, keys.shape[1], num_heads // keys.shape[1], head_dim)
    mask = view.window_mask if sliding else view.mask
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    flat = out.reshape(view.rows_used, num_heads * head_dim)
    return flat if view.query_rows is None else flat.index_select(0, view.query_rows)
