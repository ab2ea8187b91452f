"""The sim backend's output is a function of the request, not of where it was prefilled.

The sim places EOS at one output position of each request. A request handed over to another
worker (its worker was SIGKILLed) is prefilled there with its prompt plus what it streamed; with
`ignore_eos`, its stream must still hold exactly one EOS, at the same position as without the
hand-over (the stream is the sim's tokens, in order, with nothing repeated).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from clients.client import StepwiseClient, generate_request, sampling_params
from control_plane.tokenizer import Tokenizer
from data_plane.sim import RULE_MIN_OUTPUT, RULE_SPAN

pytestmark = pytest.mark.timeout(180)
# Past every output length the sim's seeded rule can give: the EOS has streamed by then.
PAST_EOS = RULE_MIN_OUTPUT + RULE_SPAN + 8
MAX_NEW = PAST_EOS + 300
# A request id whose seeded output length (data_plane/sim.py) is short: 29 tokens, so an EOS placed
# again after the hand-over would fall well inside MAX_NEW.
RID = "h3"
RULE_SHORT = 29


async def _stream_until_killed(client: StepwiseClient, plane, workers) -> list[int]:  # type: ignore[no-untyped-def]
    request = generate_request([5, 6, 7, 8], sampling_params(max_new_tokens=MAX_NEW, ignore_eos=True), RID)
    tokens: list[int] = []
    killed = False
    async for response in client.stream(request):
        if response.WhichOneof("event") == "chunk":
            tokens.extend(response.chunk.token_ids)
        if not killed and len(tokens) > PAST_EOS:
            info = await client.server_info()
            busy = [w.worker_id for w in info.workers if w.running]
            assert len(busy) == 1, busy
            os.kill(workers[busy[0]].pid, signal.SIGKILL)
            killed = True
    assert killed
    return tokens


async def test_a_handed_over_ignore_eos_request_streams_one_eos(start_control, model_dir) -> None:
    eos = Tokenizer.from_dir(model_dir).eos_token_ids
    plane = await start_control("--routing-policy", "least-loaded")
    # A step of 3 ms: the stream passes its EOS in a second or two, and the kill lands mid-stream.
    workers = {w: plane.add_worker(w, "--sim-cost", "0.003,0,0") for w in ("a", "b")}
    await plane.wait_workers(2)
    async with StepwiseClient(plane.address) as client:
        handed_over = await asyncio.wait_for(_stream_until_killed(client, plane, workers), 120)
        # The same request again, uninterrupted on the surviving worker: the sim's tokens depend on
        # the request id and position only.
        deadline = time.monotonic() + 30
        while len((await client.server_info()).workers) != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        whole = await client.generate([5, 6, 7, 8], request_id=RID, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert len(handed_over) == MAX_NEW
    assert [i for i, t in enumerate(whole.token_ids) if t in eos] == [RULE_SHORT]
    assert [t for t in handed_over if t in eos] == [t for t in whole.token_ids if t in eos]
    assert sum(t in eos for t in handed_over) == 1
    assert handed_over == whole.token_ids
