"""`stepwise bench`: a load generator with serving metrics.

Sends `--requests` generations at `--concurrency` in flight (or at `--rate` per second, Poisson),
with prompt lengths drawn from a seeded generator, optionally sharing a prefix per group, and
prints TTFT, TPOT, ITL, throughput and the prefix-cache hit rate, as text or one JSON object.
Calls the control plane refuses (RESOURCE_EXHAUSTED when its queue is full, ...) are counted by
status code under "refused"; the statistics cover the completed requests only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO, TypedDict

import grpc

from clients.client import (
    StepwiseClient,
    add_connection_arguments,
    client_from_args,
    generate_request,
    sampling_params,
)
from protos.stepwise.v1 import generation_pb2 as gen_pb


class Report(TypedDict):
    """What `stepwise bench` prints, in this order. Statistics cover the completed requests only."""

    requests: int
    completed: int
    refused: dict[str, int]  # status code name -> calls that ended with it
    duration_s: float
    request_throughput: float
    output_throughput_tok_s: float
    total_throughput_tok_s: float
    prefix_hit_rate: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    latency_p50_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    parser.add_argument("--requests", type=int, default=64, help="generations to send")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (when --rate is 0)")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="Poisson arrivals per second (0: closed loop)"
    )
    parser.add_argument("--prompt-len", default="32,256", help="min,max prompt tokens (uniform)")
    parser.add_argument("--output-len", default="16,128", help="min,max new tokens (uniform)")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens shared by each group's prompts")
    parser.add_argument("--groups", type=int, default=4, help="prefix groups (with --shared-prefix)")
    parser.add_argument("--vocab", type=int, default=1000, help="token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


@dataclass(slots=True)
class Sample:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    ok: bool = False
    refused: str = ""  # the status code's name when the call ended in a gRPC error


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, max(lo, hi)


def make_prompts(ns: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens) per request; deterministic in --seed."""
    rng = random.Random(ns.seed)
    prefixes = [
        [rng.randrange(3, ns.vocab) for _ in range(ns.shared_prefix)] for _ in range(max(ns.groups, 1))
    ]
    plo, phi = _range(ns.prompt_len)
    olo, ohi = _range(ns.output_len)
    out = []
    for i in range(ns.requests):
        body = [rng.randrange(3, ns.vocab) for _ in range(rng.randint(plo, phi))]
        out.append((prefixes[i % len(prefixes)] + body, rng.randint(olo, ohi)))
    return out


async def _one(client: StepwiseClient, ids: list[int], max_new: int) -> Sample:
    """One generation's timings; a call that ends in a gRPC error comes back with `refused` set."""
    sample = Sample(prompt_tokens=len(ids))
    request = generate_request(ids, sampling_params(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    try:
        await _stream(client, request, sample, start)
    except grpc.aio.AioRpcError as exc:
        sample.refused = exc.code().name
    sample.latency = time.perf_counter() - start
    return sample


async def _stream(
    client: StepwiseClient, request: gen_pb.GenerateRequest, sample: Sample, start: float
) -> None:
    last = start
    async for response in client.stream(request):
        now = time.perf_counter()
        if response.WhichOneof("event") == "chunk" and response.chunk.token_ids:
            if sample.output_tokens == 0:
                sample.ttft = now - start
            else:
                sample.itls.append(now - last)
            sample.output_tokens += len(response.chunk.token_ids)
            last = now
        elif response.WhichOneof("event") == "finished":
            sample.cached_tokens = response.finished.usage.cached_tokens
            sample.ok = response.finished.reason != gen_pb.FINISH_REASON_ABORT


async def run(ns: argparse.Namespace, out: TextIO = sys.stdout) -> Report:
    """Send the load, print the report (text, or JSON with --json) to `out`, and return it."""
    prompts = make_prompts(ns)
    rng = random.Random(ns.seed + 1)
    async with client_from_args(ns) as client:
        await client.wait_ready(ns.wait)
        gate = asyncio.Semaphore(ns.concurrency if ns.rate <= 0 else len(prompts))

        async def limited(ids: list[int], n: int) -> Sample:
            async with gate:
                return await _one(client, ids, n)

        started = time.perf_counter()
        tasks = []
        for ids, n in prompts:
            tasks.append(asyncio.create_task(limited(ids, n)))
            if ns.rate > 0:
                await asyncio.sleep(rng.expovariate(ns.rate))
        samples = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    report = summarize(samples, elapsed)
    out.write((json.dumps(report) if ns.json else render(report)) + "\n")
    return report


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(samples: list[Sample], elapsed: float) -> Report:
    """The report: counts over all samples, statistics over the completed ones only."""
    done = [s for s in samples if s.ok]
    refused = Counter(s.refused for s in samples if s.refused)
    ttft = [s.ttft for s in done]
    tpot = [(s.latency - s.ttft) / (s.output_tokens - 1) for s in done if s.output_tokens > 1]
    itl = [x for s in done for x in s.itls]
    prompt = sum(s.prompt_tokens for s in done)
    cached = sum(s.cached_tokens for s in done)
    output = sum(s.output_tokens for s in done)
    return {
        "requests": len(samples),
        "completed": len(done),
        "refused": dict(sorted(refused.items())),
        "duration_s": round(elapsed, 4),
        "request_throughput": round(len(done) / elapsed, 3),
        "output_throughput_tok_s": round(output / elapsed, 2),
        "total_throughput_tok_s": round((prompt + output) / elapsed, 2),
        "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_mean_ms": round(1000 * statistics.fmean(ttft), 2) if ttft else 0.0,
        "ttft_p50_ms": round(1000 * _pct(ttft, 0.5), 2),
        "ttft_p99_ms": round(1000 * _pct(ttft, 0.99), 2),
        "tpot_mean_ms": round(1000 * statistics.fmean(tpot), 3) if tpot else 0.0,
        "itl_p50_ms": round(1000 * _pct(itl, 0.5), 3),
        "itl_p99_ms": round(1000 * _pct(itl, 0.99), 3),
        "latency_p50_s": round(_pct([s.latency for s in done], 0.5), 4),
    }


def render(report: Report) -> str:
    """One `key  value` line per entry; "refused" as `CODE count, ...` or `none`."""
    width = max(len(k) for k in report)
    return "\n".join(f"{k:<{width}}  {_render_value(v)}" for k, v in report.items())


def _render_value(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{code} {count}" for code, count in value.items()) or "none"
    return str(value)
