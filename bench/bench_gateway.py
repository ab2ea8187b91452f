"""The gateway's cost: its added latency per token, and its CPU per server-sent event under load.

Two modes, each on one `stepwise up` with the gateway:

- latency (the default): the embedded model on CPU; N greedy generations of T tokens each
  (ignore_eos, so every one is T tokens), one at a time, alternating direct gRPC and HTTP/SSE so both
  see the same cache and load. Prints ms/token (whole request / T, and inter-token after the first)
  per path and the ratio.
- load (`--streams S`): a sim worker (`--sim-cost`) and the control plane at `--stream-interval`;
  rounds of S concurrent streams of T tokens each, alternating direct gRPC and the gateway's
  `/v1/completions` (read by a minimal HTTP/1.1 client, so the client's own cost stays small). Prints
  tokens/s per path, and the gateway's CPU (user + system, its process and every descendant: all
  of `--gateway-workers`, from /proc) per SSE event and per token.

    .venv/bin/python bench/bench_gateway.py --requests 20 --tokens 64
    .venv/bin/python bench/bench_gateway.py --streams 64 --tokens 256 --rounds 3
    .venv/bin/python bench/bench_gateway.py --streams 64 --tokens 256 --rounds 3 --gateway-workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from bench_control import sse_stream as read_sse  # the sibling script: bench/ is on sys.path

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


async def latency(ns: argparse.Namespace) -> None:
    gateway = gateway_args(CONTROL, "127.0.0.1", 0) + _workers_flag(ns)
    stack = Stack(CONTROL, ["--log-level", "warning"], 1, gateway)
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


# --- load: S concurrent streams, tokens/s and the gateway's CPU per event ------------------------


@dataclass(slots=True)
class Round:
    tokens: int = 0
    events: int = 0  # SSE `data:` events read (the gateway path), [DONE] included
    seconds: float = 0.0
    gateway_cpu_s: float = 0.0


async def grpc_stream(client: StepwiseClient, prompt: str, tokens: int) -> tuple[int, int]:
    """(tokens, messages) of one streamed generation, directly over gRPC."""
    request = generate_request(
        prompt, sampling_params(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    )
    count = messages = 0
    async for response in client.stream(request):
        messages += 1
        if response.WhichOneof("event") == "chunk":
            count += len(response.chunk.token_ids)
    return count, messages


async def sse_stream(host: str, port: int, prompt: str, tokens: int) -> tuple[int, int]:
    """(tokens, SSE events) of one streamed `/v1/completions`, read off the socket by bench_control's
    raw HTTP/1.1 reader (so the client's own cost stays small)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    seen = [0, 0]  # tokens (from the usage event), events

    def on_event(data: bytes) -> None:
        seen[1] += 1
        if b'"usage"' in data and (usage := json.loads(data).get("usage")):
            seen[0] = usage["completion_tokens"]

    await read_sse(host, port, body, on_event)
    return seen[0], seen[1]


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of `root` and its live descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
    pids, todo = [root], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        pids.extend(kids)
        todo.extend(kids)
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = _stat(pid)
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


async def load(ns: argparse.Namespace) -> None:
    control = [*CONTROL, "--stream-interval", str(ns.stream_interval), "--model", "embedded"]
    worker = ["--log-level", "warning", "--backend", "sim", "--sim-cost", ns.sim_cost]
    gateway = gateway_args(control, "127.0.0.1", 0) + _workers_flag(ns)
    stack = Stack(control, worker, 1, gateway)
    try:
        await stack.start()
        gateway_pid = next(child.proc.pid for child in stack.children if child.name == "gateway")
        host, port = stack.gateway_address.rsplit(":", 1)
        async with StepwiseClient(stack.address) as client:

            async def round_of(path: str, number: int) -> Round:
                prompts = [f"Once upon a time, round {number} stream {i}," for i in range(ns.streams)]
                if path == "gRPC":
                    calls = [grpc_stream(client, p, ns.tokens) for p in prompts]
                else:
                    calls = [sse_stream(host, int(port), p, ns.tokens) for p in prompts]
                cpu, start = tree_cpu_s(gateway_pid), time.perf_counter()
                results = await asyncio.gather(*calls)
                seconds = time.perf_counter() - start
                one = Round(sum(t for t, _ in results), 0, seconds, tree_cpu_s(gateway_pid) - cpu)
                if path == "gateway":
                    one.events = sum(e for _, e in results)
                expected = ns.streams * ns.tokens
                if one.tokens != expected:
                    raise RuntimeError(f"{path}: {one.tokens} tokens, expected {expected}")
                return one

            await round_of("gRPC", -1)
            await round_of("gateway", -1)
            rounds: dict[str, list[Round]] = {"gRPC": [], "gateway": []}
            for number in range(ns.rounds):
                for path in rounds:
                    rounds[path].append(await round_of(path, number))
        print(
            f"{ns.streams} streams x {ns.tokens} tokens, --stream-interval {ns.stream_interval}, sim "
            f"--sim-cost {ns.sim_cost}, gateway --workers {ns.gateway_workers}, {ns.rounds} rounds each"
        )
        rates = {}
        for path, runs in rounds.items():
            rate = sum(r.tokens for r in runs) / sum(r.seconds for r in runs)
            rates[path] = rate
            print(f"{path:8} {rate:9,.0f} tokens/s")
        runs = rounds["gateway"]
        cpu, events, tokens = (
            sum(getattr(r, f) for r in runs) for f in ("gateway_cpu_s", "events", "tokens")
        )
        per_round = ", ".join(f"{1e6 * r.gateway_cpu_s / r.events:.1f}" for r in runs)
        print(f"gateway/gRPC tokens/s: {rates['gateway'] / rates['gRPC']:.3f}")
        print(
            f"gateway CPU: {1e6 * cpu / events:.1f} µs per SSE event ({events:,} events; per round "
            f"{per_round}), {1e6 * cpu / tokens:.1f} µs per token, {cpu / sum(r.seconds for r in runs):.2f} "
            "cores while streaming"
        )
    finally:
        stack.stop()


def _workers_flag(ns: argparse.Namespace) -> list[str]:
    """The gateway's --workers, left out at 1 (so a checkout from before the flag runs too)."""
    return ["--workers", str(ns.gateway_workers)] if ns.gateway_workers != 1 else []


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20, help="latency mode: generations per path")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per generation")
    parser.add_argument(
        "--streams", type=int, default=0, help="load mode: concurrent streams per round (0: latency mode)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="load mode: measured rounds per path")
    parser.add_argument("--stream-interval", type=int, default=1, help="load mode: the control plane's")
    parser.add_argument(
        "--sim-cost", default="0.005,0,0", help="load mode: the sim worker's step time a,b,c (seconds)"
    )
    parser.add_argument("--gateway-workers", type=int, default=1, help="the gateway's --workers")
    ns = parser.parse_args()
    asyncio.run(load(ns) if ns.streams else latency(ns))
