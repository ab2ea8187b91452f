"""FlashInfer's paged-KV attention over the pool, in place (CUDA only; the optional `flashinfer`
extra). Imported only when the backend is chosen.

The pool's layer tensors are [capacity, Hkv, D]: viewed as [capacity, 1, Hkv, D] they are a paged
cache in FlashInfer's NHD layout with pages of one slot, so a sequence's page list is its slot table
and every last page holds one token. Whatever page size the control plane allocates in is honoured
because slot tables list slots in position order. A step is planned once (the indptr/indices
arrays, copied to the device once) and each layer runs the planned kernel:

- a pure decode step uses the decode wrapper (one query per sequence);
- a step with extends uses the prefill wrapper for all its entries, decodes included as one-token
  extends, causal with each entry's queries at the end of its keys (FlashInfer's convention).

Sliding-window layers get wrappers of their own, planned with `window_left = window - 1` (a query
at position p sees keys p - window + 1 .. p, as transformers' sliding window does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from data_plane.backends.base import AttendedModel, StepLayout

if TYPE_CHECKING:
    from data_plane.kv_pool import KvPool

# FlashInfer's split-KV scratch space; SGLang and vLLM use the same order of magnitude.
WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class _Plans:
    """The planned wrapper per layer kind: `full` for every layer, `window` for sliding ones."""

    full: Any
    window: Any | None


@dataclass(frozen=True, slots=True)
class FlashInferStep:
    plans: _Plans
    num_heads: int
    head_dim: int

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KvPool, sliding: bool
    ) -> torch.Tensor:
        wrapper = self.plans.window if sliding else self.plans.full
        assert wrapper is not None, "sliding layer but the step was planned without a window"
        cache = (pool.k[layer].unsqueeze(1), pool.v[layer].unsqueeze(1))
        out = wrapper.run(q.contiguous(), cache)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, model: AttendedModel) -> None:
        import flashinfer

        cfg = model.config
        self.device, self.dtype = model.device, model.dtype
        self.scale, self.window = model.scale, model.sliding_window
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # One scratch buffer: a step runs one wrapper kind at a time, layer after layer on one stream.
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        kinds = (None, self.window) if self.window is not None else (None,)
        decode, prefill = (
            flashinfer.BatchDecodeWithPagedKVCacheWrapper,
            flashinfer.BatchPrefillWithPagedKVCacheWrapper,
        )
        self._decode = {w: decode(self.workspace, "NHD") for w in kinds}
        self._prefill = {w: prefill(self.workspace, "NHD") for w in kinds}

    @property
    def nbytes(self) -> int:
        return self.workspace.numel()

    def forget(self, handles: list[int]) -> None:
        """Nothing is kept across steps: every step plans from the slot tables."""

    def invalidate(self) -> None:
        """Nothing is kept across steps."""

    def plan(self, layout: StepLayout) -> FlashInferStep:
        rows = np.concatenate((layout.ext_rows, layout.dec_rows))
        q_lens = np.concatenate((layout.ext_q_lens, np.ones(len(layout.dec_rows), dtype=np.int64)))
        kv_lens = layout.lengths[rows]
        pages = _pages(layout.slots[rows, : int(kv_lens.max())], kv_lens)
        kv_indptr = self._int32(np.concatenate(([0], np.cumsum(kv_lens))))
        indices = self._int32(pages)
        last_page_len = self._int32(np.ones(len(rows), dtype=np.int64))
        pure_decode = len(layout.ext_rows) == 0
        wrappers = self._decode if pure_decode else self._prefill
        qo_indptr = None if pure_decode else self._int32(np.concatenate(([0], np.cumsum(q_lens))))
        for window, wrapper in wrappers.items():
            common: dict[str, Any] = {
                "window_left": -1 if window is None else window - 1,
                "q_data_type": self.dtype,
                "kv_data_type": self.dtype,
                "sm_scale": self.scale,
            }
            shape = (self.num_heads, self.num_kv_heads, self.head_dim, 1)
            if qo_indptr is None:
                wrapper.plan(kv_indptr, indices, last_page_len, *shape, **common)
            else:
                wrapper.plan(qo_indptr, kv_indptr, indices, last_page_len, *shape, causal=True, **common)
        plans = _Plans(full=wrappers[None], window=wrappers.get(self.window) if self.window else None)
        return FlashInferStep(plans, self.num_heads, self.head_dim)

    def _int32(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32)).to(self.device)


def _pages(slot_rows: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    """Every row's first kv_len slots, concatenated (row-major order keeps each row's run together)."""
    return slot_rows[np.arange(slot_rows.shape[1])[None, :] < kv_lens[:, None]]
