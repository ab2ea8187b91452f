"""Prefill/decode workers against mixed ones, on the sim backend, with a prefill-heavy workload.

    python bench/bench_pd.py [--requests 64] [--rate 5] [--prompt 1500] [--new 64] [--sim-cost A,B,C]

Real processes on 127.0.0.1 (`stepwise up`'s Stack): a control plane and two sim workers, either
both `mixed` or one `--role prefill` and one `--role decode` (docs/migration.md). The sim's step
takes its cost model's time, `A + B·(new tokens) + C·(Σ context)` seconds (default: the sim's own),
so a long prompt's prefill holds its worker for a while; its KV moves over the real transfer link,
as many bytes as the embedded model's. Requests of `--prompt` random tokens and `--new` new ones
arrive as a seeded Poisson process at `--rate` a second. For each way, in milliseconds at p50 and
p99: the time to first token (from the request's send), the gap between the first and second token
(under pd the hand-off to the decode worker), and the inter-token latency from there on (each gap
between two later tokens of a stream); then the seconds until the last stream ended and the requests
that moved. Run it twice and read the figures side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from clients.client import StepwiseClient, generate_request, sampling_params
from stepwise.up import Stack

WAYS = {
    "mixed": [["--role", "mixed"], ["--role", "mixed"]],
    "pd": [["--role", "prefill"], ["--role", "decode"]],
}


async def _one(client: StepwiseClient, ids: list[int], new: int, delay: float) -> tuple[float, list[float]]:
    """(TTFT, the gaps between its tokens) of one greedy request sent after `delay` seconds."""
    await asyncio.sleep(delay)
    request = generate_request(ids, sampling_params(max_new_tokens=new, temperature=0.0, ignore_eos=True))
    sent = time.monotonic()
    stamps: list[float] = []
    finished = None
    async for response in client.stream(request):
        if response.WhichOneof("event") == "chunk":
            stamps.extend([time.monotonic()] * len(response.chunk.token_ids))
        elif response.WhichOneof("event") == "finished":
            finished = response.finished
    assert len(stamps) == new, f"{len(stamps)} tokens of {new}: {finished}"
    return stamps[0] - sent, [b - a for a, b in itertools.pairwise(stamps)]


async def run(way: str, requests: int, rate: float, prompt: int, new: int, sim_cost: str) -> dict[str, float]:
    control = ["--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]
    worker = ["--log-level", "warning", "--backend", "sim", "--sim-cost", sim_cost]
    stack = Stack(control, worker, 2, each_worker_args=WAYS[way])
    try:
        await stack.start(timeout=120)
        rng = random.Random(requests)
        prompts = [[rng.randrange(3, 1000) for _ in range(prompt)] for _ in range(requests)]
        delays = list(itertools.accumulate(rng.expovariate(rate) for _ in range(requests)))
        start = time.monotonic()
        async with StepwiseClient(stack.address) as client:
            results = await asyncio.gather(
                *(_one(client, p, new, d) for p, d in zip(prompts, delays, strict=True))
            )
            done = time.monotonic() - start
            moved = sum(w.migrated_out for w in (await client.server_info()).workers)
        ttft = np.array([r[0] for r in results])
        second = np.array([r[1][0] for r in results])  # the hand-off's gap, under pd
        itl = np.array([g for r in results for g in r[1][1:]])

        def ms(values: np.ndarray, q: float) -> float:
            return 1e3 * float(np.percentile(values, q))

        return {
            "ttft_p50": ms(ttft, 50),
            "ttft_p99": ms(ttft, 99),
            "second_p50": ms(second, 50),
            "second_p99": ms(second, 99),
            "itl_p50": ms(itl, 50),
            "itl_p99": ms(itl, 99),
            "done_s": done,
            "moved": moved,
        }
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=5.0, help="arrivals a second (Poisson)")
    parser.add_argument("--prompt", type=int, default=1500)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--sim-cost", default="0.005,0.00005,0.0000005")
    ns = parser.parse_args()
    columns = ("ttft_p50", "ttft_p99", "second_p50", "second_p99", "itl_p50", "itl_p99", "done_s", "moved")
    print(f"{'way':>6} " + " ".join(f"{c:>10}" for c in columns))
    for way in WAYS:
        r = asyncio.run(run(way, ns.requests, ns.rate, ns.prompt, ns.new, ns.sim_cost))
        print(f"{way:>6} " + " ".join(f"{r[c]:>10.1f}" for c in columns))


if __name__ == "__main__":
    main()
