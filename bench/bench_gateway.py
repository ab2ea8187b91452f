"""The gateway's added latency per token: the same streamed generations, direct gRPC vs HTTP/SSE.

One `stepwise up` (embedded model, CPU) with the gateway; N greedy generations of T tokens each
(ignore_eos, so every one is T tokens), one at a time, alternating paths so both see the same cache
and load. Prints ms/token (whole request / T, and inter-token after the first) per path and the ratio.

    .venv/bin/python bench/bench_gateway.py --requests 20 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from clients.client import StepwiseClient, generate_request, sampling_params
from stepwise.up import Stack, gateway_args

CONTROL = ["--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]


async def via_grpc(client: StepwiseClient, prompt: str, tokens: int) -> tuple[float, float, int]:
    """(seconds total, seconds from first to last token, tokens) for one streamed generation."""
    request = generate_request(
        prompt, sampling_params(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    )
    start, first, count = time.perf_counter(), 0.0, 0
    async for response in client.stream(request):
        if response.WhichOneof("event") == "chunk" and response.chunk.token_ids:
            first = first or time.perf_counter()
            count += len(response.chunk.token_ids)
    end = time.perf_counter()
    return end - start, end - first, count


async def via_gateway(http: httpx.AsyncClient, prompt: str, tokens: int) -> tuple[float, float, int]:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    start, first, count = time.perf_counter(), 0.0, 0
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                first = first or time.perf_counter()
            if event.get("usage"):
                count = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    return end - start, end - first, count


def report(name: str, runs: list[tuple[float, float, int]]) -> tuple[float, float]:
    total = statistics.mean(1000 * t / n for t, _, n in runs)
    itl = statistics.mean(1000 * d / max(n - 1, 1) for _, d, n in runs)
    print(
        f"{name:8} {len(runs)} runs: {total:7.3f} ms/token whole request, {itl:7.3f} ms/token after the first"
    )
    return total, itl


async def main(ns: argparse.Namespace) -> None:
    stack = Stack(CONTROL, ["--log-level", "warning"], 1, gateway_args(CONTROL, "127.0.0.1", 0))
    try:
        await stack.start()
        prompts = [f"Once upon a time, number {i}," for i in range(ns.requests)]
        grpc_runs, http_runs = [], []
        async with (
            StepwiseClient(stack.address) as client,
            httpx.AsyncClient(base_url=f"http://{stack.gateway_address}", timeout=60) as http,
        ):
            await via_grpc(client, "warm up", 8)
            await via_gateway(http, "warm up", 8)
            for prompt in prompts:
                grpc_runs.append(await via_grpc(client, prompt, ns.tokens))
                http_runs.append(await via_gateway(http, prompt, ns.tokens))
        g_total, g_itl = report("gRPC", grpc_runs)
        h_total, h_itl = report("gateway", http_runs)
        print(
            f"ratio gateway/gRPC: {h_total / g_total:.3f} whole request, {h_itl / g_itl:.3f} after the first"
        )
        print(f"added: {h_total - g_total:+.3f} ms/token whole request, {h_itl - g_itl:+.3f} after the first")
    finally:
        stack.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    asyncio.run(main(parser.parse_args()))
