"""A hung decode worker holds no stream (issue 37, item 1): prefill worker p0, decode workers d0 and
d1 on the sim backend; d0 is SIGSTOPped while idle (a hung host, a debugger, a long pause), and 10
new streams come. Before, all 10 were handed to d0 and sat after their first token for as long as
it hung (90 s in the issue), d1 getting none. Now no stream waits past the control plane's
`--worker-step-timeout` after its first token, and every one ends with all its tokens.

Both halves of the fix bear on it: the KV send's deadline and keepalive (data plane:
docs/migration.md#deadlines-and-hung-peers) bound each stall on d0, and the control plane's
releasing a dropped destination's exports, counting calls in transit in a decode worker's load and
backing off from a destination that failed keep the hung d0 from being chosen again and again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from clients.client import StepwiseClient, generate_request, sampling_params
from protos.stepwise.v1 import generation_pb2 as gen_pb

pytestmark = pytest.mark.timeout(120)

STEP_TIMEOUT_S = 5.0
STREAMS = 10
NEW_TOKENS = 40
# Longer than any stream takes when nothing hangs; a stream still running then counts as stuck.
GIVE_UP_S = 20.0


async def _longest_wait(client: StepwiseClient, i: int) -> tuple[float, int]:
    """The longest wait of one stream after its first token (between two chunks, or from its last
    chunk to when it was given up), and how many tokens it got."""
    loop = asyncio.get_running_loop()
    got, longest, last, finished = 0, 0.0, None, False
    request = generate_request(
        [7 + i, 11, 13, 17, 19], sampling_params(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    )

    async def consume() -> None:
        nonlocal got, longest, last, finished
        async for response in client.stream(request):
            if response.WhichOneof("event") == "chunk" and response.chunk.token_ids:
                now = loop.time()
                if last is not None:
                    longest = max(longest, now - last)
                got, last = got + len(response.chunk.token_ids), now
            elif response.WhichOneof("event") == "finished":
                assert response.finished.reason == gen_pb.FINISH_REASON_LENGTH, response.finished
                finished = True

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(consume(), GIVE_UP_S)
    if not finished and last is not None:
        longest = max(longest, loop.time() - last)
    return longest, got


async def test_a_hung_decode_worker_holds_no_stream_past_the_step_timeout(start_control) -> None:
    plane = await start_control(
        "--worker-step-timeout", str(STEP_TIMEOUT_S), "--worker-step-timeout-per-token", "0"
    )
    # A send's deadline well inside the step timeout: a tail stuck on d0 fails over to p0 in time.
    fast = ("--transfer-deadline-floor", "2")
    plane.add_worker("p0", "--role", "prefill", *fast)
    d0 = plane.add_worker("d0", "--role", "decode", *fast)
    await plane.wait_workers(2)  # d0 first: it wins ties with d1
    plane.add_worker("d1", "--role", "decode", *fast)
    await plane.wait_workers(3)
    os.kill(d0.pid, signal.SIGSTOP)
    try:
        async with StepwiseClient(plane.address) as client:
            waits = await asyncio.gather(*(_longest_wait(client, i) for i in range(STREAMS)))
    finally:
        os.kill(d0.pid, signal.SIGCONT)
        d0.kill()
    stuck = [round(wait, 1) for wait, _ in waits if wait > STEP_TIMEOUT_S]
    assert not stuck, f"{len(stuck)} of {STREAMS} streams waited past {STEP_TIMEOUT_S:g} s: {sorted(stuck)}"
    assert [got for _, got in waits] == [NEW_TOKENS] * STREAMS
