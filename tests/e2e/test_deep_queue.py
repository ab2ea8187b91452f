"""Cache-aware order behind a saturated worker, live on the embedded model
(docs/scheduler.md#kept-matches): 320 requests in 40 prefix groups queue far past 128; LPM with no
cutoff keeps ordering them by cached prefix and computes fewer prompt tokens than LPM with SGLang's
cutoff, which orders them FCFS past 128. Counted from the worker's reports in GetServerInfo (prompt
tokens admitted less those served from the cache), not from any clock."""

from __future__ import annotations

import asyncio
import random

import pytest

from clients.client import StepwiseClient

pytestmark = pytest.mark.timeout(180)

GROUPS, PER_GROUP, PREFIX, OWN = 40, 8, 64, 8
# A pool that holds a handful of the 40 prefixes besides the running requests' own tokens, so that
# the order decides which prefixes are still cached when their requests come up.
CONTROL = ["--schedule-policy", "lpm", "--max-running-requests", "4", "--chunked-prefill-size", "256"]
WORKER = ["--kv-tokens", "640"]


def prompts() -> list[list[int]]:
    rng = random.Random(41)
    prefixes = [[rng.randrange(10, 200) for _ in range(PREFIX)] for _ in range(GROUPS)]
    out = [
        prefixes[g] + [rng.randrange(10, 200) for _ in range(OWN)]
        for g in range(GROUPS)
        for _ in range(PER_GROUP)
    ]
    rng.shuffle(out)
    return out


async def computed_prompt_tokens(start_stack, limit: str) -> int:  # type: ignore[no-untyped-def]
    stack = await start_stack([*CONTROL, "--cache-aware-queue-limit", limit], WORKER)
    try:
        async with StepwiseClient(stack.address) as client:
            calls = [
                client.generate(p, request_id=f"r{i}", max_new_tokens=2, ignore_eos=True, temperature=0.0)
                for i, p in enumerate(prompts())
            ]
            done = await asyncio.gather(*calls)
            assert all(g.completion_tokens == 2 for g in done)
            worker = (await client.server_info()).workers[0]
    finally:
        stack.stop()
    assert worker.prompt_tokens_total >= GROUPS * PER_GROUP * (PREFIX + OWN)
    return int(worker.prompt_tokens_total - worker.cached_tokens_total)


async def test_lpm_without_cutoff_computes_fewer_prompt_tokens_behind_a_saturated_worker(start_stack) -> None:
    with_cutoff = await computed_prompt_tokens(start_stack, "128")
    without = await computed_prompt_tokens(start_stack, "0")
    print(f"prompt tokens computed: cutoff 128 {with_cutoff}, no cutoff {without}")
    assert without < 0.8 * with_cutoff
