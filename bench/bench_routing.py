"""Cache-aware routing against least-loaded routing: prefix hit rate and throughput.

`stepwise up` with 4 sim workers (the cost-model simulator: a step costs a + b·new_tokens +
c·context, so a cached prefix saves its prefill) and a shared-prefix workload: `--groups` groups
whose prompts share a `--shared-prefix`-token system prompt, arriving as a Poisson stream. Each
worker's pool holds only a few groups (`--kv-tokens`), as on a real accelerator, so where a request
goes decides whether its prefix is still cached. Both policies run in one invocation, alternating
rounds on the same prompts and arrival times; the figures are each policy's mean over its rounds.

    python bench/bench_routing.py [--rounds 2] [--kv-tokens 8192] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics

POLICIES = ("least-loaded", "cache-aware")
CONTROL = ["--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]


async def _round(policy: str, ns: argparse.Namespace) -> dict[str, float]:
    from clients import bench
    from stepwise.up import Stack

    worker = ["--log-level", "warning", "--backend", "sim", "--sim-cost", ns.sim_cost]
    worker += ["--kv-tokens", str(ns.kv_tokens)]
    stack = Stack([*CONTROL, "--routing-policy", policy], worker, ns.workers)
    try:
        await stack.start(timeout=120)
        load = argparse.Namespace(
            address=stack.address,
            wait=30.0,
            requests=ns.requests,
            concurrency=ns.requests,
            rate=ns.rate,
            prompt_len=ns.question_len,
            output_len=ns.output_len,
            shared_prefix=ns.shared_prefix,
            groups=ns.groups,
            vocab=1000,
            seed=ns.seed,
            json=True,
        )
        report = await bench.run(load, out=io.StringIO())
        return {
            "prefix_hit_rate": report["prefix_hit_rate"],
            "request_throughput": report["request_throughput"],
            "total_throughput_tok_s": report["total_throughput_tok_s"],
            "ttft_p50_ms": report["ttft_median_ms"],
            "ttft_p99_ms": report["ttft_p99_ms"],
            "completed": report["completed"],
        }
    finally:
        stack.stop()


async def main(ns: argparse.Namespace) -> None:
    results: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    for _ in range(ns.rounds):
        for policy in POLICIES:
            results[policy].append(await _round(policy, ns))
    summary = {
        policy: {key: round(statistics.fmean(r[key] for r in rounds), 4) for key in rounds[0]}
        for policy, rounds in results.items()
    }
    base, cache = summary["least-loaded"], summary["cache-aware"]
    summary["ratio"] = {
        "hit_rate": round(cache["prefix_hit_rate"] / max(base["prefix_hit_rate"], 1e-9), 3),
        "throughput": round(cache["total_throughput_tok_s"] / base["total_throughput_tok_s"], 3),
        "ttft_p50": round(cache["ttft_p50_ms"] / max(base["ttft_p50_ms"], 1e-9), 3),
    }
    if ns.json:
        print(json.dumps(summary))
        return
    print(
        f"{ns.workers} sim workers, {ns.requests} requests at {ns.rate:g}/s, {ns.groups} groups x "
        f"{ns.shared_prefix}-token prefix, questions {ns.question_len}, outputs {ns.output_len}, "
        f"kv {ns.kv_tokens} tokens/worker, {ns.rounds} round(s) each"
    )
    keys = list(base)
    print(f"{'policy':<14}" + "".join(f"{k:>24}" for k in keys))
    for policy in POLICIES:
        print(f"{policy:<14}" + "".join(f"{summary[policy][k]:>24}" for k in keys))
    print("cache-aware / least-loaded: " + ", ".join(f"{k} {v}" for k, v in summary["ratio"].items()))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--rate", type=float, default=64.0, help="Poisson arrivals per second")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--shared-prefix", type=int, default=1024)
    parser.add_argument("--question-len", default="32,64")
    parser.add_argument("--output-len", default="16,32")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="KV pool of each sim worker")
    parser.add_argument("--sim-cost", default="0.005,0.00005,0.0000005")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
