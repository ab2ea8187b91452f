"""Our bfloat16 CUDA forward against transformers' bfloat16 CUDA forward (tiny Llama and Qwen3).

Run with `tests/gpu/run.sh` or `pytest -m gpu tests/gpu`; skipped without CUDA. Checkpoints are
tiny random ones built in the test (tests/data_plane/families.py), so nothing is downloaded and the
whole module runs in seconds once CUDA is initialised.

Tolerance. Both sides round every op's output to bfloat16 (8 mantissa bits), but not at the same
points: we fuse q/k/v and gate/up into one GEMM each, gather K/V from a paged pool into padded
batches and run one SDPA per group, and cuBLAS may pick different split-K reductions for
different shapes. The logits of these checkpoints are of magnitude ~3, where one bf16 ulp is
2^-6 = 0.016; two layers of such roundings give a few ulps of difference (the CPU bf16 runs
measure up to 0.03). LOGITS_TOLERANCE = 0.125 is 8 ulps: loose enough for kernel choices, tight
enough that a wrong bias, norm or rotary (differences of order 1) fails. Greedy tokens must match,
except that at the first divergence transformers' own logits for the two tokens must be within
that tolerance (a genuine near-tie that bf16 rounding may break either way).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from data_plane.executor import Executor
from data_plane.kv_pool import KvPool
from data_plane.models.llama import LlamaModel
from tests.data_plane.factories import Driver, Extend, SlotAllocator, make_plan, new_seq
from tests.data_plane.families import BY_NAME, VOCAB, build_checkpoint, load_reference
from tests.gpu.greedy import LOGITS_TOLERANCE, compare_greedy, reference_next_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NEW_TOKENS = 12
FAMILIES = ("llama", "qwen3")


@pytest.fixture(scope="module", params=FAMILIES)
def models(request, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(ours, transformers') in bfloat16 on cuda:0 for one family."""
    return load_pair(request.param, tmp_path_factory.mktemp(request.param), torch.device("cuda", 0))


def load_pair(family: str, out: pathlib.Path, device: torch.device):  # type: ignore[no-untyped-def]
    path = build_checkpoint(BY_NAME[family], out)
    return LlamaModel.from_dir(path, device, torch.bfloat16), load_reference(
        path, torch.bfloat16, str(device)
    )


def make_executor(model: LlamaModel, capacity: int = 1024) -> Executor:
    return Executor(model, KvPool(model.config, capacity, torch.bfloat16, model.device))


def prompts(seed: int = 3) -> dict[int, list[int]]:
    rng = np.random.default_rng(seed)
    return {h: rng.integers(0, VOCAB, size=n).tolist() for h, n in ((1, 6), (2, 13), (3, 29), (4, 50))}


def batched_prefill_logits_diff(model: LlamaModel, reference) -> float:  # type: ignore[no-untyped-def]
    """Max abs logits difference for one ragged prefill of every prompt (page size 16, scrambled)."""
    executor, slots = make_executor(model), SlotAllocator(1024, 16, seed=1)
    batch = prompts()
    plan = make_plan(
        1,
        new_seqs=[new_seq(h) for h in batch],
        extends=[Extend(h, 0, p, slots.alloc(h, len(p))) for h, p in batch.items()],
    )
    ours = executor.forward_logits(plan).float().cpu()
    expected = torch.stack([reference_next_logits(reference, p) for p in batch.values()])
    return (ours - expected).abs().max().item()


def greedy_mismatches(model: LlamaModel, reference) -> list[str]:  # type: ignore[no-untyped-def]
    """Handles whose greedy tokens differ from transformers' other than at a near-tie."""
    driver = Driver(make_executor(model), SlotAllocator(1024, 4, seed=2))
    return [
        f"handle {c.handle}: ours {c.ours} transformers {c.theirs}"
        for c in compare_greedy(driver, reference, prompts(), NEW_TOKENS)
        if not c.ok
    ]


def test_bf16_logits_close_to_transformers_on_cuda(models) -> None:  # type: ignore[no-untyped-def]
    ours, reference = models
    diff = batched_prefill_logits_diff(ours, reference)
    print(f"{ours.config.family}: max abs bf16 logits diff {diff:.4f}")
    assert diff < LOGITS_TOLERANCE


def test_bf16_greedy_tokens_equal_transformers_on_cuda(models) -> None:  # type: ignore[no-untyped-def]
    ours, reference = models
    assert greedy_mismatches(ours, reference) == []
