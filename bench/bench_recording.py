"""Recording overhead, end to end: a control plane and a sim-backend worker, with and without --record.

    .venv/bin/python bench/bench_recording.py [--rounds 3] [--requests 256] [--sim-cost a,b,c]

Each round starts a fresh stack per mode (alternating, so drift hits both), sends the same load
(prompts of 64..512 token ids, 128 new tokens, ignore_eos) and measures output tokens per second
and the control plane's CPU seconds. Wall-clock throughput is noisy on a shared machine; the CPU
the recorder adds to the control plane, as a share of the run's wall time, bounds what it can cost
a step loop that plans, waits and applies serially.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from clients.client import StepwiseClient
from stepwise.up import Stack

CONTROL = ["--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "error"]
WORKER = [
    "--log-level",
    "error",
    "--backend",
    "sim",
    "--sim-cost",
    "0.002,0.000002,0",
    "--kv-tokens",
    "200000",
]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(address: str, requests: int, concurrency: int) -> tuple[float, float]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(64, 512))] for _ in range(requests)]
    gate = asyncio.Semaphore(concurrency)
    async with StepwiseClient(address) as client:

        async def one(ids: list[int]) -> int:
            async with gate:
                gen = await client.generate(ids, max_new_tokens=128, ignore_eos=True, temperature=0.0)
                return gen.completion_tokens

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        wall = time.perf_counter() - started
        return tokens / wall, wall


async def _round(record: bool, ns: argparse.Namespace) -> tuple[float, float, float]:
    """(tokens/s, wall seconds, control-plane CPU seconds during the load)."""
    with tempfile.TemporaryDirectory() as rec:
        control = [*CONTROL, *(["--record", rec] if record else [])]
        stack = Stack(control, [*WORKER, "--sim-cost", ns.sim_cost], 1)
        try:
            address = await stack.start(timeout=120)
            pid = stack.procs[0].pid
            cpu = _cpu_seconds(pid)
            rate, wall = await _load(address, ns.requests, ns.concurrency)
            return rate, wall, _cpu_seconds(pid) - cpu
        finally:
            stack.stop()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--sim-cost", default="0.005,0.00005,0.0000005", help="the sim worker's a,b,c")
    ns = parser.parse_args()
    runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for _ in range(ns.rounds):
        for record in (False, True):
            runs[record].append(await _round(record, ns))
    for record in (False, True):
        rates = [round(r[0]) for r in runs[record]]
        cpu = [round(r[2], 2) for r in runs[record]]
        print(f"--record {'on ' if record else 'off'}: tokens/s {rates}, control-plane CPU s {cpu}")
    off = statistics.median(r[0] for r in runs[False])
    on = statistics.median(r[0] for r in runs[True])
    extra_cpu = statistics.median(r[2] for r in runs[True]) - statistics.median(r[2] for r in runs[False])
    wall = statistics.median(r[1] for r in runs[True])
    print(f"throughput change with --record: {100 * (on / off - 1):+.1f}% (median tokens/s)")
    print(
        f"recorder CPU on the control plane: {extra_cpu:.2f} s over a {wall:.1f} s run "
        f"= {100 * extra_cpu / wall:.1f}%"
    )


if __name__ == "__main__":
    asyncio.run(main())
