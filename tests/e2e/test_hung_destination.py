"""A hung decode worker holds no stream (issue 37, item 1; real processes on the sim backend).

Prefill worker p0, decode workers d0 and d1; d0 is SIGSTOPped while idle (a hung host, a debugger,
a long pause): it is never dropped, since no step of it is in flight, and the copies handed to it
never report. Ten new streams: each hand-off counts toward its destination at once, so d0 does not
take them all; and a copy with no word past the step deadline fails, so a call handed to d0 goes
back onto p0 and on to d1 while d0 sits out. No stream stalls after its first token for longer than
about `--worker-step-timeout`. Before: all ten went to d0 and sat there until SIGCONT.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from clients.client import StepwiseClient, generate_request, sampling_params
from protos.stepwise.v1 import generation_pb2 as gen_pb

pytestmark = pytest.mark.timeout(120)

STEP_TIMEOUT_S = 2.0
# What a stall may add to the step timeout: the source's next turn, the recompute of one token,
# and a loaded machine.
SLACK_S = 2.0


async def _longest_gap(client: StepwiseClient, ids: list[int], n: int) -> tuple[int, float]:
    """(tokens, the longest gap between two chunks after the first) of one greedy stream."""
    request = generate_request(ids, sampling_params(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    tokens, last, gap = 0, None, 0.0
    async for response in client.stream(request):
        if response.WhichOneof("event") == "chunk":
            now = time.monotonic()
            if last is not None:
                gap = max(gap, now - last)
            tokens, last = tokens + len(response.chunk.token_ids), now
        elif response.WhichOneof("event") == "finished":
            assert response.finished.reason == gen_pb.FINISH_REASON_LENGTH, response.finished
    return tokens, gap


async def test_no_stream_waits_on_a_hung_decode_worker_past_the_step_timeout(start_control) -> None:
    plane = await start_control(
        "--worker-step-timeout", str(STEP_TIMEOUT_S), "--worker-step-timeout-per-token", "0"
    )
    roles = {"p0": "prefill", "d0": "decode", "d1": "decode"}
    procs = {worker: plane.add_worker(worker, "--role", role) for worker, role in roles.items()}
    await plane.wait_workers(3)
    os.kill(procs["d0"].pid, signal.SIGSTOP)
    try:
        async with StepwiseClient(plane.address) as client:
            calls = [_longest_gap(client, [5 + i, 6, 7, 8, 9, 10, 11, 12], 40) for i in range(10)]
            got = await asyncio.wait_for(asyncio.gather(*calls), 30)
    finally:
        os.kill(procs["d0"].pid, signal.SIGCONT)
    assert [tokens for tokens, _ in got] == [40] * 10
    gaps = sorted(round(gap, 2) for _, gap in got)
    assert gaps[-1] < STEP_TIMEOUT_S + SLACK_S, f"longest gaps after the first token (s): {gaps}"
