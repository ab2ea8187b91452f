"""The physical KV pool: K and V for every layer, indexed by slot id.

The control plane owns which slots are free; the pool only stores what the plan says to store.
One tensor per K/V holds all layers: [num_layers, capacity, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_plane.models.loader import ModelConfig


@dataclass(frozen=True, slots=True)
class HostCopy:
    """A sequence's K/V moved to host memory by an offload: [num_layers, n, num_kv_heads, head_dim] each."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.k.shape[1])


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Pool bytes one token slot costs across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * elem


def capacity_tokens(
    config: ModelConfig,
    dtype: torch.dtype,
    kv_tokens: int | None,
    kv_bytes: int,
    page_size: int,
) -> int:
    """Slots the pool gets: `kv_tokens` if given, else what `kv_bytes` buys; rounded down to whole pages."""
    tokens = kv_tokens if kv_tokens is not None else kv_bytes // bytes_per_token(config, dtype)
    tokens -= tokens % page_size
    if tokens < page_size:
        raise ValueError(f"KV budget too small: {tokens} tokens for page size {page_size}")
    return tokens


class KvPool:
    """Device K/V storage. Callers guarantee slot ids lie in [0, capacity)."""

    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (config.num_layers, capacity, config.num_kv_heads, config.head_dim)
        # Zeros, not empty: a gathered-but-masked slot must never be NaN (0 * NaN poisons attention).
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K/V ([n, num_kv_heads, head_dim]) for n tokens at `slots` ([n] int64)."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def copy_out(self, slots: torch.Tensor) -> HostCopy:
        """A host-side copy of every layer's K/V at `slots`, in the given order."""
        return HostCopy(k=self.k[:, slots].to("cpu"), v=self.v[:, slots].to("cpu"))

    def copy_in(self, slots: torch.Tensor, saved: HostCopy) -> None:
        """Write a HostCopy back into `slots` (same count as when it was taken)."""
        self.k[:, slots] = saved.k.to(self.k.device)
        self.v[:, slots] = saved.v.to(self.v.device)
