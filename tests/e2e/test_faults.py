"""Fault tests: a worker killed mid-generation; its streams continue on the other worker."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from clients.client import Generation, StepwiseClient, apply_response, generate_request, sampling_params
from tests.e2e.conftest import reference_greedy
from tests.e2e.test_generate import _books_settle, _encode_all

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 120


async def _stream(
    client: StepwiseClient, ids: list[int], progress: list[int], i: int, max_new: int = MAX_NEW
) -> Generation:
    """A greedy stream of `max_new` tokens (EOS ignored); `progress[i]` counts what arrived."""
    gen = Generation()
    request = generate_request(ids, sampling_params(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
    async for response in client.stream(request):
        apply_response(gen, response)
        progress[i] = len(gen.token_ids)
    return gen


@pytest.mark.slow
async def test_killed_worker_streams_continue_on_the_other_without_loss_or_repetition(
    start_stack, model_dir: Path
) -> None:
    stack = await start_stack(workers=2)
    prompts, eos = _encode_all(model_dir)
    prompts = prompts[:6]
    progress = [0] * len(prompts)
    async with StepwiseClient(stack.address) as client:
        tasks = [asyncio.create_task(_stream(client, ids, progress, i)) for i, ids in enumerate(prompts)]
        while min(progress) < 10:
            await asyncio.sleep(0.005)
        stack.procs[1].send_signal(signal.SIGKILL)  # worker-0, mid-generation
        gens = await asyncio.gather(*tasks)
        info = await client.server_info()
    assert [w.worker_id for w in info.workers] == ["worker-1"]
    for ids, gen in zip(prompts, gens, strict=True):
        assert (gen.finish_reason, gen.completion_tokens) == ("length", MAX_NEW), gen.finish_message
        # Greedy continuation from prompt + streamed tokens is exact: no token lost or repeated.
        assert gen.token_ids == reference_greedy(model_dir, ids, MAX_NEW, eos, ignore_eos=True)
    await _books_settle(stack.address)


async def test_last_worker_lost_ends_streams_with_a_reason(start_stack) -> None:
    stack = await start_stack()
    async with StepwiseClient(stack.address) as client:
        task = asyncio.create_task(client.generate("Once upon a time", max_new_tokens=1500, ignore_eos=True))
        while (await client.server_info()).running < 1:
            await asyncio.sleep(0.01)
        stack.procs[1].send_signal(signal.SIGKILL)
        gen = await task
    assert gen.finish_reason == "abort"
    assert "disconnected" in gen.finish_message and "no other worker" in gen.finish_message
