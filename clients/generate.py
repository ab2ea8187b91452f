"""`stepwise generate`: stream one generation to the terminal, then usage and timings."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from clients.client import Generation, StepwiseClient, apply_response, generate_request, sampling_params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument("--address", default="127.0.0.1:50051", help="control plane client address")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--wait", type=float, default=30.0, help="seconds to wait for a serving control plane"
    )


async def run(ns: argparse.Namespace, out: TextIO = sys.stdout) -> Generation:
    sampling = sampling_params(
        max_new_tokens=ns.max_new_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )
    gen = Generation()
    async with StepwiseClient(ns.address) as client:
        await client.wait_ready(ns.wait)
        out.write(ns.prompt)
        out.flush()
        async for response in client.stream(generate_request(ns.prompt, sampling)):
            apply_response(gen, response)
            if response.WhichOneof("event") == "chunk":
                out.write(response.chunk.text)
                out.flush()
    out.write("\n")
    out.write(summary(gen) + "\n")
    out.flush()
    return gen


def summary(gen: Generation) -> str:
    tps = gen.completion_tokens / gen.total_s if gen.total_s > 0 else 0.0
    reason = gen.finish_reason + (f" ({gen.finish_message})" if gen.finish_message else "")
    return (
        f"[finish: {reason} | prompt {gen.prompt_tokens} tokens, cached {gen.cached_tokens}, "
        f"completion {gen.completion_tokens} | queue {gen.queue_s * 1000:.1f} ms, "
        f"ttft {gen.ttft_s * 1000:.1f} ms, total {gen.total_s * 1000:.1f} ms, {tps:.1f} tok/s]"
    )
