"""The portable attention backend: padded groups over the paged pool for torch's SDPA
(data_plane/attention.py), and on CPU the decode block for pure decode groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from data_plane.attention import AttentionGroup, DecodeGroup, build_group, decode_attention, paged_attention
from data_plane.backends.base import AttendedModel, StepLayout
from data_plane.decode_cache import DecodeCache

if TYPE_CHECKING:
    from data_plane.kv_pool import KvPool


@dataclass(frozen=True, slots=True)
class SdpaStep:
    """The step's groups, covering its flat tokens in order (extends, then decodes)."""

    groups: tuple[AttentionGroup | DecodeGroup, ...]
    scale: float

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KvPool, sliding: bool
    ) -> torch.Tensor:
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        outputs = []
        for g in self.groups:
            group_q = q[g.token_start : g.token_start + g.token_count]
            if isinstance(g, DecodeGroup):
                outputs.append(decode_attention(group_q, k_pool, v_pool, g, layer, self.scale, sliding))
            else:
                outputs.append(paged_attention(group_q, k_pool, v_pool, g, self.scale, sliding))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


class SdpaBackend:
    """Gathers keys and values per group; `decode_cache` (CPU) keeps the decode set's in a block."""

    name = "sdpa"

    def __init__(self, model: AttendedModel, decode_cache: bool = True) -> None:
        cfg = model.config
        self.device, self.dtype = model.device, model.dtype
        self.scale, self.sliding_window = model.scale, model.sliding_window
        self.decode_cache = (
            DecodeCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device)
            if decode_cache
            else None
        )

    @property
    def nbytes(self) -> int:
        return self.decode_cache.nbytes if self.decode_cache is not None else 0

    def forget(self, handles: list[int]) -> None:
        if self.decode_cache is not None:
            self.decode_cache.forget(handles)

    def invalidate(self) -> None:
        if self.decode_cache is not None:
            self.decode_cache.invalidate()

    def plan(self, layout: StepLayout) -> SdpaStep:
        groups = (
            self._group(0, layout.ext_q_lens, layout.ext_rows, layout),
            self._decode_group(layout.num_ext_tokens, layout),
        )
        return SdpaStep(tuple(g for g in groups if g is not None), self.scale)

    def _group(
        self, token_start: int, q_lens: np.ndarray, rows: np.ndarray, layout: StepLayout
    ) -> AttentionGroup | None:
        if len(rows) == 0:
            return None
        kv_lens = layout.lengths[rows]
        slot_rows = layout.slots[rows, : int(kv_lens.max())]
        return build_group(
            token_start, q_lens, kv_lens, slot_rows, self.device, self.dtype, self.sliding_window
        )

    def _decode_group(self, token_start: int, layout: StepLayout) -> AttentionGroup | DecodeGroup | None:
        rows = layout.dec_rows
        if self.decode_cache is None or len(rows) == 0:
            return self._group(token_start, np.ones(len(rows), dtype=np.int64), rows, layout)
        kv_lens = layout.lengths[rows]
        token_slots = layout.slots[rows, kv_lens - 1]
        view = self.decode_cache.step(
            layout.dec_handles, kv_lens, layout.slots, rows, token_slots, self.sliding_window
        )
        return DecodeGroup(token_start=token_start, token_count=len(rows), view=view)
