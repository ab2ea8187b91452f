"""The decode fast path (data_plane/decode_cache.py) against the general paged path.

Two executors over the same model, one with the decode cache and one without, run the same plans:
prompts, a cached prefix shared by later sequences (their first slots are another sequence's),
mixed extend + decode steps, a decode set that is steady for a few steps, then reordered, joined,
left (with and without a release) and rejoined, and a sequence growing past the cache's first
capacity step. Every step's logits agree within 1e-5 (float32), on page sizes 1, 4 and 16, for the
embedded Llama and for sliding-window configs (Mistral: every layer; Qwen2: the upper layer only).
Tokens are fed by the test (teacher forcing), so both executors see identical inputs.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from data_plane.backends.sdpa import SdpaBackend
from data_plane.config import add_arguments, config_from_args
from data_plane.decode_cache import DecodeCache
from data_plane.executor import Executor
from data_plane.kv_pool import KvPool
from data_plane.models.llama import LlamaModel
from protos.worker import StepPlan, sampled_handles
from tests.data_plane.factories import Extend, SlotAllocator, make_plan, new_seq
from tests.data_plane.families import BY_NAME, build_checkpoint

CPU = torch.device("cpu")
TOLERANCE = 1e-5
CAPACITY = 2048


@pytest.fixture(scope="module")
def window_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LlamaModel]:
    """Sliding-window checkpoints: Mistral (window 7, every layer), Qwen2 (window 5, layer 1 only)."""
    models = {}
    for name in ("mistral", "qwen2_window"):
        model_dir = build_checkpoint(BY_NAME[name], tmp_path_factory.mktemp(name))
        models[name] = LlamaModel.from_dir(model_dir, CPU, torch.float32)
    return models


class Twin:
    """The same plans through a fast-path executor and a general-path one; compares every step."""

    def __init__(self, model: LlamaModel, page_size: int) -> None:
        self.fast, self.general = (
            Executor(model, KvPool(model.config, CAPACITY, torch.float32, CPU), decode_cache=on)
            for on in (True, False)
        )
        self.slots = SlotAllocator(CAPACITY, page_size, seed=page_size)
        self.tables: dict[int, list[int]] = {}
        self.rng = np.random.default_rng(page_size)
        self.vocab = model.config.vocab_size
        self.live: set[int] = set()
        self.step_id = 0

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(3, self.vocab, size=n).tolist()

    def extend(self, handle: int, n: int, prefix_of: int | None = None, prefix_len: int = 0) -> Extend:
        """A new sequence's extend of n tokens, after `prefix_len` slots shared with `prefix_of`."""
        slots = self.slots.alloc(handle, n)
        prefix = self.tables[prefix_of][:prefix_len] if prefix_of is not None else []
        self.tables[handle] = [*prefix, *slots.tolist()]
        return Extend(handle, len(prefix), self.tokens(n), slots)

    def decode(self, handle: int) -> tuple[int, int]:
        slot = int(self.slots.alloc(handle, 1)[0])
        self.tables[handle].append(slot)
        return handle, slot

    def step(
        self, extends: tuple[Extend, ...] = (), decodes: tuple[int, ...] = (), releases: tuple[int, ...] = ()
    ) -> None:
        """Run one plan on both executors; extends of unknown handles start new sequences."""
        staying = self.live - set(releases)  # a released handle may come back in the same plan
        seqs = [
            new_seq(e.handle, prefix_slots=np.array(self.tables[e.handle][: e.start], dtype=np.int64))
            for e in extends
            if e.handle not in staying
        ]
        self.live = staying | {e.handle for e in extends}
        self.step_id += 1
        plan = make_plan(self.step_id, extends, [self.decode(h) for h in decodes], seqs, releases=releases)
        fast, general = self._run(self.fast, plan), self._run(self.general, plan)
        torch.testing.assert_close(fast, general, atol=TOLERANCE, rtol=0)

    def _run(self, executor: Executor, plan: StepPlan) -> torch.Tensor:
        """The plan's logits; then every sampling row gets the same next token on both executors."""
        logits = executor.forward_logits(plan)
        handles = sampled_handles(plan)
        next_ids = np.random.default_rng(self.step_id).integers(3, self.vocab, len(handles))
        executor.table.last_token[executor.table.rows(handles)] = next_ids
        return logits


def _scenario(twin: Twin) -> None:
    a, b, c, d = 1, 2, 3, 4
    twin.step(extends=(twin.extend(a, 124), twin.extend(c, 9)))
    # B starts from A's first 16 slots (a cached prefix); mixed with decodes of A and C.
    twin.step(extends=(twin.extend(b, 5, prefix_of=a, prefix_len=16),), decodes=(a, c))
    for _ in range(3):  # steady: the cache only appends (A crosses 128 positions here)
        twin.step(decodes=(a, b, c))
    twin.step(decodes=(c, a, b))  # reorder
    # D joins through an extend that shares A's first 8 slots, in a mixed step.
    twin.step(extends=(twin.extend(d, 3, prefix_of=a, prefix_len=8),), decodes=(c, a, b))
    for _ in range(2):
        twin.step(decodes=(c, a, b, d))
    twin.step(decodes=(a, b, d), releases=(c,))  # C leaves with a release
    twin.step(decodes=(a, d))  # B sits out a step without any delta
    for _ in range(2):
        twin.step(decodes=(a, b, d))  # B is back
    twin.step(extends=(twin.extend(c + 10, 30),), decodes=(a, b, d))  # an extend beside decodes
    twin.step(decodes=(a, b, d))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_fast_path_matches_general_path(our_model: LlamaModel, page_size: int) -> None:
    _scenario(Twin(our_model, page_size))


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("family", ["mistral", "qwen2_window"])
def test_fast_path_matches_general_path_with_sliding_window(
    window_models: dict[str, LlamaModel], family: str, page_size: int
) -> None:
    _scenario(Twin(window_models[family], page_size))


def _cache_step(cache: DecodeCache, handles: list[int], lens: list[int], table: np.ndarray):  # type: ignore[no-untyped-def]
    rows = np.array(handles, dtype=np.int64)
    return cache.step(
        np.array(handles, dtype=np.int64), np.array(lens), table, rows, rows * 1000, sliding_window=None
    )


def _loaded(view) -> list[int]:  # type: ignore[no-untyped-def]
    """Block rows the step loads from the pool."""
    return [] if view.load_rows is None else view.load_rows.tolist()


def test_cache_loads_only_rows_that_joined_or_changed() -> None:
    cache = DecodeCache(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=CPU)
    table = np.arange(4 * 300, dtype=np.int64).reshape(4, 300)
    assert _loaded(_cache_step(cache, [0, 1], [5, 7], table)) == [0, 1]  # first step
    view = _cache_step(cache, [0, 1], [6, 8], table)  # steady: nothing to load, rows in order
    assert _loaded(view) == [] and view.query_rows is None and view.mask is not None
    view = _cache_step(cache, [1, 0], [9, 7], table)  # a reorder permutes queries only
    assert _loaded(view) == [] and view.query_rows is not None and view.query_rows.tolist() == [1, 0]
    assert _loaded(_cache_step(cache, [1, 0], [10, 9], table)) == [0]  # 0's length jumped: reload
    assert _loaded(_cache_step(cache, [1, 0, 2], [11, 10, 3], table)) == [2]  # a join
    view = _cache_step(cache, [1, 2], [12, 4], table)  # 0 leaves: its row idles (key 0 only)
    assert _loaded(view) == [] and view.rows_used == 3 and view.query_rows.tolist() == [1, 2]
    cache.forget([2])
    assert _loaded(_cache_step(cache, [1, 2], [13, 5], table)) == [0]  # forgotten: reloaded
    assert _loaded(_cache_step(cache, [1, 2], [200, 6], table)) == [0, 1]  # the block grew
    cache.invalidate()
    assert _loaded(_cache_step(cache, [1, 2], [201, 7], table)) == [0, 1]


def test_equal_lengths_need_no_mask() -> None:
    cache = DecodeCache(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=CPU)
    table = np.zeros((2, 16), dtype=np.int64)
    view = _cache_step(cache, [0, 1], [6, 6], table)
    assert view.mask is None and view.window_mask is None


def test_worker_flag_turns_the_cache_off(our_model: LlamaModel) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--model", "/m"])).decode_cache
    assert not config_from_args(parser.parse_args(["--model", "/m", "--disable-decode-cache"])).decode_cache
    pool = KvPool(our_model.config, 64, torch.float32, CPU)
    attention = Executor(our_model, pool, decode_cache=False).attention
    assert isinstance(attention, SdpaBackend) and attention.decode_cache is None


def test_a_reused_handle_never_reads_the_released_sequences_keys(our_model: LlamaModel) -> None:
    """A released handle comes back, in the same plan, as a new sequence of the same length, and no
    decode step runs in between: its next decode is one position past the old row, so only
    forgetting the row on release keeps the old sequence's keys out of it."""
    twin = Twin(our_model, page_size=1)
    a, b = 1, 2
    twin.step(extends=(twin.extend(a, 20), twin.extend(b, 7)))
    for _ in range(2):
        twin.step(decodes=(a, b))  # A's row now holds 22 positions
    twin.step(extends=(twin.extend(a, 22),), releases=(a,))  # extend only: no decode sees the swap
    for _ in range(2):
        twin.step(decodes=(a, b))


def test_after_a_reset_reused_handles_start_from_the_pool(our_model: LlamaModel) -> None:
    """A new session (reset) reuses handles from 1 again, at lengths where a stale row would fit."""
    twin = Twin(our_model, page_size=4)
    a, b = 1, 2
    twin.step(extends=(twin.extend(a, 12), twin.extend(b, 5)))
    for _ in range(2):
        twin.step(decodes=(a, b))
    for executor in (twin.fast, twin.general):
        executor.reset()
    twin.live.clear()
    twin.slots = SlotAllocator(CAPACITY, 4, seed=99)
    twin.step(extends=(twin.extend(a, 14), twin.extend(b, 7)))
    for _ in range(2):
        twin.step(decodes=(a, b))
