"""Attention backends (data_plane/backends): choosing one, and the flashinfer backend's paged
metadata against the SDPA path.

FlashInfer itself needs CUDA, so here the `flashinfer` module is tests/data_plane/fake_flashinfer.py,
which computes what FlashInfer's wrappers document from the same arguments. Through it, the backend's
plans (page lists from slot tables, indptr arrays, causal extends after cached prefixes, decodes,
sliding windows) must give the SDPA backend's logits within 1e-5 in float32, on page sizes 1/4/16.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from data_plane.backends import BackendError, make_backend
from data_plane.executor import Executor
from data_plane.kv_pool import KvPool
from data_plane.models.llama import LlamaModel
from data_plane.models.loader import ModelLoadError
from tests.data_plane import fake_flashinfer
from tests.data_plane.families import BY_NAME, build_checkpoint
from tests.data_plane.test_decode_fast_path import CAPACITY, CPU, Twin, _scenario


@pytest.fixture
def with_fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)


def flashinfer_twin(model: LlamaModel, page_size: int) -> Twin:
    """`fast` runs the flashinfer backend (on the fake), `general` the SDPA backend without the
    decode block: the path every other test checks against transformers."""
    from data_plane.backends.flashinfer import FlashInferBackend

    twin = Twin(model, page_size)
    pool = KvPool(model.config, CAPACITY, torch.float32, CPU)
    twin.fast = Executor(model, pool, attention=FlashInferBackend(model))
    return twin


@pytest.mark.usefixtures("with_fake_flashinfer")
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_flashinfer_plans_match_the_sdpa_path(our_model: LlamaModel, page_size: int) -> None:
    twin = flashinfer_twin(our_model, page_size)
    _scenario(twin)
    backend = twin.fast.attention
    assert all(w.runs for w in backend._prefill.values())  # type: ignore[attr-defined]
    assert all(w.runs for w in backend._decode.values())  # type: ignore[attr-defined]


@pytest.mark.usefixtures("with_fake_flashinfer")
@pytest.mark.parametrize("family", ["mistral", "qwen2_window"])
def test_flashinfer_sliding_windows_match_the_sdpa_path(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = LlamaModel.from_dir(
        build_checkpoint(BY_NAME[family], tmp_path_factory.mktemp(family)), CPU, torch.float32
    )
    twin = flashinfer_twin(model, page_size=4)
    _scenario(twin)
    # FlashInfer's windowed wrappers themselves ran: the SDPA path was not compared with itself.
    backend = twin.fast.attention
    window = backend.window  # type: ignore[attr-defined]
    assert window is not None
    assert backend._prefill[window].runs and backend._decode[window].runs  # type: ignore[attr-defined]


def test_auto_is_sdpa_on_cpu_and_flashinfer_is_refused_there(our_model: LlamaModel) -> None:
    assert make_backend("auto", our_model).name == "sdpa"
    assert make_backend("sdpa", our_model, decode_cache=False).decode_cache is None  # type: ignore[attr-defined]
    with pytest.raises(BackendError, match="needs a CUDA device"):
        make_backend("flashinfer", our_model)
    with pytest.raises(BackendError, match="unknown attention backend 'xformers'"):
        make_backend("xformers", our_model)


@pytest.mark.usefixtures("with_fake_flashinfer")
def test_flashinfer_is_auto_only_on_cuda_in_16_bit(
    our_model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the choice is asked (nothing runs on the pretended device)."""
    import data_plane.backends.flashinfer as flashinfer_backend

    monkeypatch.setattr(flashinfer_backend.FlashInferBackend, "__init__", lambda self, model: None)
    monkeypatch.setattr(our_model, "device", torch.device("cuda"))
    assert make_backend("auto", our_model).name == "sdpa"  # float32: FlashInfer has no such kernels
    with pytest.raises(BackendError, match=r"float16 or bfloat16, not torch\.float32"):
        make_backend("flashinfer", our_model)
    monkeypatch.setattr(our_model, "dtype", torch.bfloat16)
    assert make_backend("auto", our_model).name == "flashinfer"


def test_a_worker_asked_for_flashinfer_on_cpu_fails_to_load_with_the_reason(model_dir: pathlib.Path) -> None:
    from data_plane.config import WorkerConfig
    from data_plane.worker import load_worker

    config = WorkerConfig(model=model_dir, device="cpu", kv_tokens=64, attention_backend="flashinfer")
    with pytest.raises(ModelLoadError, match="flashinfer attention backend needs a CUDA device"):
        load_worker(config)
