"""What new grammars cost the streams already running on a worker (issue 37, item 4; not a test):
`python bench/bench_grammar_stall.py [--grammars 12] [--kind ebnf|json]`.

`stepwise up` on the embedded model (one worker, 127.0.0.1), a few background streams without a
grammar, then N distinct large grammars at once (GBNF of ~1,200 rules and 64 KB each, or JSON
schemas of 5,000 properties), each asking for a few tokens. It prints the background streams'
longest gap between chunks before and while the grammars arrive, how the grammar calls ended, and
whether the worker was dropped (its step count restarting, or none attached).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.client import StepwiseClient, generate_request, sampling_params
from protos.stepwise.v1 import generation_pb2 as gen_pb
from tests.processes import ready_file


def gbnf(seed: int, rules: int = 1200) -> str:
    r = random.Random(seed)
    lines = ["root ::= r0"]
    for i in range(rules - 1):
        other = r.randint(i + 1, rules - 1)
        lines.append(f'r{i} ::= "w{seed}x{i}" r{i + 1} | [a-z]{{1,3}} "{r.randint(0, 999)}" | r{other} "y"')
    lines.append(f'r{rules - 1} ::= "end"')
    return "\n".join(lines)


def schema(seed: int, properties: int = 5000) -> str:
    return json.dumps(
        {"type": "object", "properties": {f"p{seed}_{i}": {"type": "integer"} for i in range(properties)}}
    )


async def background(client: StepwiseClient, gaps: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """One stream after another until `stop`, each chunk's arrival time noted as (time, gap)."""
    while not stop.is_set():
        request = generate_request(
            "Once upon a time", sampling_params(max_new_tokens=400, ignore_eos=True), ""
        )
        last = time.monotonic()
        async for _ in client.stream(request):
            now = time.monotonic()
            gaps.append((now, now - last))
            last = now
            if stop.is_set():
                break


async def constrained(address: str, kind: str, text: str) -> str:
    """One grammar call on a connection of its own (without API keys, a frontend knows a caller by
    its connection, and bounds each caller's compiles)."""
    async with StepwiseClient(address) as client:
        return await _constrained(client, kind, text)


async def _constrained(client: StepwiseClient, kind: str, text: str) -> str:
    sampling = sampling_params(max_new_tokens=4)
    if kind == "ebnf":
        sampling.ebnf = text
    else:
        sampling.json_schema = text
    try:
        async for response in client.stream(generate_request("Hi", sampling, "")):
            if response.WhichOneof("event") == "finished":
                return gen_pb.FinishReason.Name(response.finished.reason)
    except Exception as exc:  # a refusal: its code
        code = getattr(exc, "code", None)
        return code().name if callable(code) else type(exc).__name__
    return "no finish"


async def run(ns: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp())
    ready = tmp / "up.json"
    args = ["up", "--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]
    args += ["--ready-file", str(ready)]
    proc = subprocess.Popen([sys.executable, "-m", "stepwise.cli", *args], env={**os.environ})
    try:
        address = (await ready_file(ready, proc, 180, "stepwise up"))["address"]
        async with StepwiseClient(address) as client:
            info = await client.server_info()
            steps_before = info.workers[0].steps
            gaps: list[tuple[float, float]] = []
            stop = asyncio.Event()
            streams = [asyncio.create_task(background(client, gaps, stop)) for _ in range(ns.streams)]
            await asyncio.sleep(5)
            sent = time.monotonic()
            texts = [gbnf(i) if ns.kind == "ebnf" else schema(i) for i in range(ns.grammars)]
            endings = await asyncio.gather(*(constrained(address, ns.kind, t) for t in texts))
            answered = time.monotonic() - sent
            await asyncio.sleep(3)
            stop.set()
            await asyncio.gather(*streams, return_exceptions=True)
            info = await client.server_info()
        before = max((g for t, g in gaps if t < sent), default=0.0)
        during = max((g for t, g in gaps if t >= sent), default=0.0)
        counts = {e: endings.count(e) for e in sorted(set(endings))}
        dropped = not info.workers or info.workers[0].steps < steps_before
        print(
            f"{ns.grammars} {ns.kind} grammars: answered in {answered:.1f} s, endings {counts}; "
            f"background longest gap {before:.2f} s before, {during:.2f} s while they arrived; "
            f"worker dropped: {dropped}"
        )
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--grammars", type=int, default=12)
    parser.add_argument("--kind", choices=("ebnf", "json"), default="ebnf")
    parser.add_argument("--streams", type=int, default=4)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
