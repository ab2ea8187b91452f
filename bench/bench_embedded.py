"""Does the worker wait for its plans? The embedded model end to end, with and without overlap.

`stepwise up` with one worker on the embedded model; 64 greedy requests (prompts of 16-128 tokens,
outputs of 8-256, ignore_eos), 32 at a time. The worker reports, per step, how long it waited for
the plan after it had finished the step before; its idle fraction is that wait over wait plus step
time, summed over the run (GetServerInfo). Both modes run in one invocation, alternating rounds;
`OMP_NUM_THREADS=1` by default so that torch's timings are stable on a small machine.

    python bench/bench_embedded.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

ROOT_FLAGS = ["--port", "0", "--worker-port", "0", "--log-level", "warning"]


async def _round(overlap: bool, ns: argparse.Namespace) -> dict[str, float]:
    from clients.client import StepwiseClient
    from stepwise.up import Stack

    control = [*ROOT_FLAGS, *([] if overlap else ["--disable-overlap-schedule"])]
    stack = Stack(control, ["--log-level", "warning"], 1)
    rng = random.Random(ns.seed)
    work = [
        ([rng.randrange(10, 1000) for _ in range(rng.randint(16, 128))], rng.randint(8, 256))
        for _ in range(ns.requests)
    ]
    try:
        await stack.start(timeout=180)
        async with StepwiseClient(stack.address) as client:
            before = (await client.server_info()).workers[0]
            queue: asyncio.Queue[tuple[list[int], int]] = asyncio.Queue()
            for item in work:
                queue.put_nowait(item)
            tokens = 0

            async def one() -> None:
                nonlocal tokens
                while not queue.empty():
                    prompt, n = queue.get_nowait()
                    gen = await client.generate(prompt, max_new_tokens=n, ignore_eos=True, temperature=0.0)
                    tokens += len(gen.token_ids)

            started = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(ns.concurrency)))
            elapsed = time.perf_counter() - started
            after = (await client.server_info()).workers[0]
    finally:
        stack.stop()
    wait = after.wait_total_s - before.wait_total_s
    busy = after.step_total_s - before.step_total_s
    return {
        "tokens_per_s": tokens / elapsed,
        "idle_fraction": wait / max(wait + busy, 1e-9),
        "steps": after.steps - before.steps,
        "wait_p99_ms": after.wait_p99_s * 1e3,
    }


async def run(ns: argparse.Namespace) -> dict[str, object]:
    rounds: dict[str, list[dict[str, float]]] = {"overlap": [], "no-overlap": []}
    for _ in range(ns.rounds):
        for mode in rounds:
            rounds[mode].append(await _round(mode == "overlap", ns))
    summary: dict[str, object] = {"requests": ns.requests, "concurrency": ns.concurrency}
    for mode, results in rounds.items():
        summary[mode] = {
            key: round(sorted(r[key] for r in results)[len(results) // 2], 4) for key in results[0]
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds per mode (the median is printed)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(asyncio.run(run(ns)), indent=2))


if __name__ == "__main__":
    main()
