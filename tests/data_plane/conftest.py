"""Fixtures for data-plane tests: the embedded model (ours and transformers'), executors, drivers."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest
import torch

from data_plane.executor import Executor
from data_plane.kv_pool import KvPool
from data_plane.models.llama import LlamaModel
from stepwise.models import resolve_model
from tests.data_plane.factories import Driver, SlotAllocator


@pytest.fixture(scope="session")
def model_dir() -> pathlib.Path:
    return resolve_model("embedded")


@pytest.fixture(scope="session")
def hf_model(model_dir: pathlib.Path):  # type: ignore[no-untyped-def]
    """transformers' own implementation of the embedded checkpoint, the reference for logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def our_model(model_dir: pathlib.Path) -> LlamaModel:
    return LlamaModel.from_dir(model_dir, torch.device("cpu"), torch.float32)


@pytest.fixture
def make_executor(our_model: LlamaModel) -> Callable[..., Executor]:
    """A fresh executor (new pool and tables) over the shared float32 CPU model."""

    def make(capacity: int = 4096, host_pool_tokens: int = 0, seed: int = 0) -> Executor:
        pool = KvPool(our_model.config, capacity, torch.float32, torch.device("cpu"))
        return Executor(our_model, pool, host_pool_tokens=host_pool_tokens, seed=seed)

    return make


@pytest.fixture
def make_driver(make_executor: Callable[..., Executor]) -> Callable[..., Driver]:
    def make(page_size: int = 1, seed: int = 0, capacity: int = 4096) -> Driver:
        return Driver(make_executor(capacity=capacity, seed=seed), SlotAllocator(capacity, page_size, seed))

    return make
