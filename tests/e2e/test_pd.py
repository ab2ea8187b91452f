"""Prefill and decode workers end to end (docs/migration.md#prefill-and-decode-workers): a control
plane, a `--role prefill` and a `--role decode` worker on the embedded model, real gRPC between the
planes and between the workers' transfer links. Greedy outputs equal transformers' `generate`, and
the loss of either worker is survived."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from clients.client import StepwiseClient
from tests.e2e.conftest import reference_greedy
from tests.e2e.test_generate import MAX_NEW, _encode_all, _greedy_all
from tests.e2e.test_migration import _books_settle_all, _stream_greedy, _workers

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


async def _pd_plane(start_control):  # type: ignore[no-untyped-def]
    plane = await start_control()
    procs = {
        "p0": plane.add_worker("p0", "--role", "prefill", sim=False),
        "d0": plane.add_worker("d0", "--role", "decode", sim=False),
    }
    await plane.wait_workers(2)
    return plane, procs


async def test_prefill_and_decode_workers_stream_what_transformers_generates(
    start_control, model_dir: Path
) -> None:
    plane, _ = await _pd_plane(start_control)
    prompts, eos = _encode_all(model_dir)
    got = await _greedy_all(plane.address, prompts, MAX_NEW)
    for ids, n, tokens in zip(prompts, MAX_NEW, got, strict=True):
        assert tokens == reference_greedy(model_dir, ids, n, eos), f"prompt of {len(ids)} tokens"
    workers = {w.worker_id: w for w in await _workers(plane.address)}
    p0, d0 = workers["p0"], workers["d0"]
    assert (p0.role, d0.role) == ("prefill", "decode")
    assert p0.migrated_out > 0 and p0.migrated_out == d0.migrated_in and p0.migration_fallbacks == 0
    # Every prompt was prefilled on p0; d0 computed one continuation token per request it took.
    assert p0.prompt_tokens_total >= sum(len(ids) for ids in prompts)
    assert d0.prompt_tokens_total - d0.cached_tokens_total == d0.migrated_in
    await _books_settle_all(plane.address)


@pytest.mark.parametrize("victim", ["p0", "d0"])
async def test_the_loss_of_a_prefill_or_a_decode_worker_is_survived(
    start_control, model_dir: Path, victim: str
) -> None:
    """SIGKILL while some requests decode on d0 and others are still on p0: every stream ends with
    exactly the tokens transformers gives (the survivor continues the lost worker's requests)."""
    plane, procs = await _pd_plane(start_control)
    prompts, eos = _encode_all(model_dir)
    new = 60
    progress = [0] * len(prompts)
    async with StepwiseClient(plane.address) as client:
        tasks = [
            asyncio.create_task(_stream_greedy(client, ids, new, progress, i))
            for i, ids in enumerate(prompts)
        ]
        deadline = asyncio.get_running_loop().time() + 60
        while sum(w.migrated_out for w in (await client.server_info()).workers) < 2:
            assert asyncio.get_running_loop().time() < deadline, "nothing moved to the decode worker"
            await asyncio.sleep(0.01)
        procs[victim].kill()
        got = await asyncio.gather(*tasks)
    for ids, tokens in zip(prompts, got, strict=True):
        assert tokens == reference_greedy(model_dir, ids, new, eos, ignore_eos=True)
