"""A decode worker stopped during copies, dropped and resumed takes hand-offs as before (issue 37,
item 3; docs/migration.md#what-a-destination-holds).

Prefill worker p0 and decode worker d0 (`--transfer-buffer-bytes 65536`) on the sim backend, whose
K and V are 1 KiB a token. d0 is SIGSTOPped while it decodes, and three hand-offs of 10 KiB each
are sent to it meanwhile; the control plane drops it at its step deadline; it is resumed and
attaches again. Before, the copies that landed after its session ended stayed in its buffer for
good (30,720 bytes), and a 40 KiB hand-off, which fit before, was refused at every step after.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from clients.client import StepwiseClient, generate_request, sampling_params
from tests.polling import until

pytestmark = pytest.mark.timeout(120)

STEP_TIMEOUT_S = 2.0


async def _worker(client: StepwiseClient, worker_id: str):  # type: ignore[no-untyped-def]
    """The worker's entry in GetServerInfo, None while it is not attached."""
    return next((w for w in (await client.server_info()).workers if w.worker_id == worker_id), None)


def _request(prompt_tokens: int, new_tokens: int, seed: int):  # type: ignore[no-untyped-def]
    prompt = [(seed * 31 + i) % 1000 + 3 for i in range(prompt_tokens)]
    return generate_request(prompt, sampling_params(max_new_tokens=new_tokens, ignore_eos=True))


async def _run(client: StepwiseClient, prompt_tokens: int, new_tokens: int, seed: int) -> None:
    async for _ in client.stream(_request(prompt_tokens, new_tokens, seed)):
        pass


async def test_a_decode_worker_dropped_during_copies_takes_hand_offs_after_it_resumes(start_control) -> None:
    plane = await start_control(
        "--worker-step-timeout", str(STEP_TIMEOUT_S), "--worker-step-timeout-per-token", "0"
    )
    plane.add_worker("p0", "--role", "prefill")
    d0 = plane.add_worker("d0", "--role", "decode", "--transfer-buffer-bytes", "65536")
    await plane.wait_workers(2)
    background: list[asyncio.Task[None]] = []
    async with StepwiseClient(plane.address) as client:
        try:
            await _run(client, 40, 8, seed=0)  # a 40 KiB hand-off fits the empty buffer
            assert (await _worker(client, "d0")).migrated_in == 1
            # d0 decodes two long requests: it has plans in hand when it stops, and misses them.
            background += [asyncio.create_task(_run(client, 5, 2000, seed=s)) for s in (1, 2)]

            async def decoding() -> bool:
                return (await _worker(client, "d0")).migrated_in == 3

            await until(decoding, 30, "the long requests to move to d0", every_s=0.05)
            os.kill(d0.pid, signal.SIGSTOP)
            try:
                background += [asyncio.create_task(_run(client, 10, 8, seed=s)) for s in (3, 4, 5)]

                async def dropped() -> bool:
                    return await _worker(client, "d0") is None

                await until(dropped, 30, "the stopped d0 to be dropped", every_s=0.05)
                # The long requests would move back to d0 with more KV than its buffer takes.
                for task in background[:2]:
                    task.cancel()
            finally:
                os.kill(d0.pid, signal.SIGCONT)

            async def back() -> bool:
                return await _worker(client, "d0") is not None

            await until(back, 30, "d0 to attach again", every_s=0.05)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*background, return_exceptions=True), 15)

            async def idle() -> bool:
                return all(w.book_live_seqs == 0 for w in (await client.server_info()).workers)

            await until(idle, 30, "the earlier requests to finish", every_s=0.05)
            p0 = await _worker(client, "p0")
            await asyncio.wait_for(_run(client, 40, 8, seed=6), 30)
            after = await _worker(client, "p0")
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            os.kill(d0.pid, signal.SIGCONT)
    refused = after.migration_fallbacks - p0.migration_fallbacks
    assert refused == 0, f"the 40 KiB hand-off failed {refused} times after d0 came back"
    assert after.migrated_out == p0.migrated_out + 1
