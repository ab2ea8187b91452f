"""New calls and control calls are served under a streaming load that outruns the one frontend: a
new caller's first token and a GetServerInfo answer still come within seconds' bounds.

The load runs in a process of its own (load_streams.py), so this process's loop only probes. The
bounds are a guard against the stalls a frontend falls into when streaming work queues ahead of
admission and replies (the old design read the core's verdicts and replies behind a backlog of
token messages: probes waited up to 6.6 s here); they are loose enough for a loaded 2-core
machine, where the processes of this test alone take both cores. The finer measure, TTFT p50/p99
beside the load, is bench/bench_control.py's (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time

import grpc
import pytest

from clients.client import generate_request, sampling_params
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc

pytestmark = pytest.mark.timeout(240)

# 1,024 streams on four sim workers of 10 ms steps: up to 102,400 tokens/s at --stream-interval 1,
# more client messages than one frontend process sends (about 20,000 a second per core).
LOAD_CONNECTIONS, LOAD_STREAMS = 32, 32
STEP_S = 0.01
WORKERS = 4
PROBES = 8
# A new call's first token and a GetServerInfo answer, worst of the probes, in seconds.
TTFT_BOUND_S = 2.5
INFO_BOUND_S = 2.0


async def _first_token_s(address: str) -> float:
    """A new caller on a connection of its own: seconds from sending to its first chunk."""
    sampling = sampling_params(max_new_tokens=2, ignore_eos=True, temperature=0.0)
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        await asyncio.wait_for(channel.channel_ready(), 10)
        stub = gen_grpc.GenerationStub(channel)
        started = time.perf_counter()
        call = stub.Generate(generate_request([9, 10, 11], sampling), timeout=30)
        async for response in call:
            if response.WhichOneof("event") == "chunk":
                took = time.perf_counter() - started
                call.cancel()
                return took
    raise AssertionError("the probe ended without a chunk")


async def _server_info_s(stub: gen_grpc.GenerationStub) -> float:
    started = time.perf_counter()
    await stub.GetServerInfo(gen_pb.GetServerInfoRequest(), timeout=30)
    return time.perf_counter() - started


async def test_new_calls_and_server_info_are_answered_first_under_a_saturating_stream_load(
    start_control,
) -> None:
    plane = await start_control("--stream-interval", "1", "--frontends", "1")
    for k in range(WORKERS):
        plane.add_worker(f"sim-{k}", "--sim-cost", f"{STEP_S},0,0", "--kv-tokens", "1048576")
    await plane.wait_workers(WORKERS)
    load = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.e2e.load_streams",
            plane.address,
            str(LOAD_CONNECTIONS),
            str(LOAD_STREAMS),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    plane.procs.append(load)  # type: ignore[arg-type]
    assert load.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(load.stdout.readline), 90)
    assert line.strip() == "ready", line
    await asyncio.sleep(3.0)  # the load settles: the frontend is as far behind as it gets
    async with grpc.aio.insecure_channel(plane.address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        await _server_info_s(stub)
        ttfts, infos = [], []
        for _ in range(PROBES):
            ttfts.append(await _first_token_s(plane.address))
            infos.append(await _server_info_s(stub))
            await asyncio.sleep(0.2)
    assert load.poll() is None, "the load client died"
    summary = (
        f"first token p50 {statistics.median(ttfts):.3f} s, max {max(ttfts):.3f} s; "
        f"GetServerInfo p50 {statistics.median(infos):.3f} s, max {max(infos):.3f} s"
    )
    print(summary)
    assert max(ttfts) <= TTFT_BOUND_S, summary
    assert max(infos) <= INFO_BOUND_S, summary
