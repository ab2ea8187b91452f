"""What an attention backend is (the protocols the executor and the model call) and what it is
given: a step's layout, and the model's geometry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from data_plane.kv_pool import KvPool
    from data_plane.models.loader import ModelConfig


class AttendedModel(Protocol):
    """What a backend reads of the model it serves (a LlamaModel)."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    # Softmax scale (1/sqrt(head_dim) unless the family says otherwise).
    scale: float
    # The sliding window of the layers that use one, or None when no layer does.
    sliding_window: int | None


class BackendError(Exception):
    """The chosen backend cannot run here (wrong device, library not installed)."""


@dataclass(frozen=True, slots=True)
class StepLayout:
    """One step's attention, host side. Flat tokens are the extend entries' tokens in order, then
    one token per decode entry; the tables already count this step's tokens."""

    ext_rows: np.ndarray  # [E] table rows of the extend entries
    ext_q_lens: np.ndarray  # [E] new tokens of each
    dec_handles: np.ndarray  # [D] handles of the decode entries
    dec_rows: np.ndarray  # [D] their table rows
    lengths: np.ndarray  # the sequence table's kv length per row
    slots: np.ndarray  # the sequence table's slot ids per row ([rows, max_context])

    @property
    def num_ext_tokens(self) -> int:
        return int(self.ext_q_lens.sum())


class StepAttention(Protocol):
    """A planned step: attention for every layer of it."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KvPool, sliding: bool
    ) -> torch.Tensor:
        """[T, num_heads * head_dim] for the step's T flat tokens; `q` [T, H, D] is rotated, `k`/`v`
        [T, Hkv, D] are this step's keys and values, already written to the pool at layer `layer`."""
        ...


class AttentionBackend(Protocol):
    name: str

    def plan(self, layout: StepLayout) -> StepAttention: ...

    def forget(self, handles: list[int]) -> None:
        """These sequences' slot tables were replaced, rewritten or ended."""
        ...

    def invalidate(self) -> None:
        """Anything the backend keeps across steps may be stale (a failed step, a reset)."""
        ...

    @property
    def nbytes(self) -> int:
        """Device bytes the backend holds besides the pool."""
        ...
