"""Attention backends: how one step's attention is planned (once per step, on the host) and run
(once per layer, on the device).

The executor describes a step's attention as a StepLayout: which table rows extend by how many
tokens, which rows decode one token, and the slot tables (already holding this step's slots). A
backend turns that into a StepAttention, which the model calls per layer after writing the layer's
K/V into the pool. Two backends exist:

- `sdpa` (data_plane/backends/sdpa.py), the portable default: keys and values are gathered from the
  pool into padded groups for torch's `scaled_dot_product_attention`; on CPU, decodes read the
  decode block (data_plane/decode_cache.py) instead.
- `flashinfer` (data_plane/backends/flashinfer.py), CUDA only: FlashInfer's paged-KV kernels read
  the pool in place (a slot is a page of one token), no gather and no padding. Imported only when
  chosen, from the optional `flashinfer` extra.

`auto` picks flashinfer on CUDA in float16/bfloat16 (FlashInfer's kernels) when it is installed,
else sdpa.
"""

from __future__ import annotations

from data_plane.backends.base import AttendedModel, AttentionBackend, BackendError
from data_plane.config import BACKENDS


def make_backend(name: str, model: AttendedModel, decode_cache: bool = True) -> AttentionBackend:
    """The backend `name` (one of BACKENDS) for `model`'s device; BackendError if it cannot run."""
    import torch

    from data_plane.backends.sdpa import SdpaBackend

    if name not in BACKENDS:
        raise BackendError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    half = model.dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        on_cuda = model.device.type == "cuda" and half
        name = "flashinfer" if on_cuda and flashinfer_installed() else "sdpa"
    if name == "sdpa":
        return SdpaBackend(model, decode_cache=decode_cache)
    if model.device.type != "cuda":
        raise BackendError(f"the flashinfer attention backend needs a CUDA device, not {model.device}")
    if not half:
        raise BackendError(f"the flashinfer attention backend runs float16 or bfloat16, not {model.dtype}")
    if not flashinfer_installed():
        raise BackendError(
            "the flashinfer attention backend needs FlashInfer (pip install 'stepwise[flashinfer]')"
        )
    from data_plane.backends.flashinfer import FlashInferBackend

    return FlashInferBackend(model)


def flashinfer_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None
