"""Live migration end to end (docs/migration.md): two real workers on the embedded model, real gRPC
between the planes and between the workers' transfer links."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from clients.client import StepwiseClient
from tests.e2e.test_generate import _encode_all, _greedy_all, MAX_NEW
from tests.e2e.conftest import reference_greedy

pytestmark = pytest.mark.timeout(300)


async def _workers(address: str) -> list:  # type: ignore[type-arg]
    async with StepwiseClient(address) as client:
        return list((await client.server_info()).workers)


async def _books_settle_all(address: str, timeout: float = 10.0) -> None:
    """Every worker's books and report agree at zero."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        workers = await _workers(address)
        states = [(w.book_live_seqs, w.reported_live_seqs, w.book_seq_slots, w.reported_seq_slots) for w in workers]
        if all(state == (0, 0, 0, 0) for state in states):
            assert all(w.kv_mismatches == 0 for w in workers)
            return
        assert asyncio.get_running_loop().time() < deadline, f"books did not settle: {states}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("control", "worker"),
    [
        ([], []),
        (["--disable-overlap-schedule"], []),
        (["--chunked-prefill-size", "16"], ["--page-size", "4"]),
    ],
    ids=["overlap", "no-overlap", "chunk16-page4"],
)
async def test_greedy_with_test_migrate_equals_transformers(
    start_stack, model_dir: Path, control: list[str], worker: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE", "1")
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE_INTERVAL", "3")
    stack = await start_stack(control, worker, workers=2)
    prompts, eos = _encode_all(model_dir)
    got = await _greedy_all(stack.address, prompts, MAX_NEW)
    for ids, n, tokens in zip(prompts, MAX_NEW, got, strict=True):
        assert tokens == reference_greedy(model_dir, ids, n, eos), f"prompt of {len(ids)} tokens"
    workers = await _workers(stack.address)
    assert sum(w.migrated_out for w in workers) > 0, "the knob was meant to migrate requests"
    assert sum(w.migrated_out for w in workers) == sum(w.migrated_in for w in workers)
    assert sum(w.migration_fallbacks for w in workers) == 0
    await _books_settle_all(stack.address)
