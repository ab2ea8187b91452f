"""A Generate call checked once: CPU per call on each side of the frontend link.

- core: the hub's whole arrival path (decode a FrontendMessage of 1,000 arrivals, read each one's
  checked parameters, route, build the scheduler's Arrival; a stub engine takes it), per arrival,
  for a plain call and for one held to a JSON Schema of 20 / 500 properties;
- frontend: a call held to a schema the frontend compiled already (a client repeating its schema):
  check the request (client_codec) and look the grammar up in the compiler's cache, per call, with
  the JSON reads per call counted.

CPU time (time.process_time), best of 5-7 rounds.

    python bench/bench_arrival.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from control_plane import link_params
from control_plane.config import ControlConfig
from control_plane.core.hub import FrontendHub, _Link
from control_plane.core.inbox import Arrival
from control_plane.frontend import client_codec
from control_plane.frontend.generation import as_run
from control_plane.frontend.grammars import GrammarCompiler
from grammars import nesting
from protos.stepwise.v1 import frontend_pb2 as fe_pb
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import reports_pb2 as reports_pb
from stepwise.models import resolve_model

ARRIVALS = 1000
CALLS = 200


def schema(properties: int) -> str:
    return json.dumps(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
    )


def sampling(properties: int | None) -> gen_pb.SamplingParams:
    msg = gen_pb.SamplingParams(max_new_tokens=128, temperature=0.7, top_p=0.9, stop=["\n\n"], seed=1)
    if properties is not None:
        msg.json_schema = schema(properties)
    return msg


class _Engine:
    scheduler = SimpleNamespace(input_length_error=lambda n: None)
    limits = SimpleNamespace(grammar_backends=("llguidance",))
    worker = "w0"

    def __init__(self) -> None:
        self.submitted: list[Arrival] = []

    def submit(self, arrival: Arrival) -> None:
        self.submitted.append(arrival)


def core_us_per_arrival(properties: int | None) -> float:
    request = gen_pb.GenerateRequest(text="x", sampling=sampling(properties))
    params = client_codec.generate_input_from_proto(request).params
    grammar = params.sampler.grammar
    if grammar is not None:
        grammar = dataclasses.replace(grammar, backend="llguidance")
    checked = link_params.to_proto(as_run(params, grammar, "raw"))
    ids = np.arange(1, 201, dtype="<i4").tobytes()
    msg = fe_pb.FrontendMessage()
    for i in range(ARRIVALS):
        msg.arrivals.add(
            request_id=f"r{i}",
            uids=[(1 << 40) | (i + 1)],
            input_ids=ids,
            params=checked,
            constraint_field="sampling.json_schema" if grammar else "",
            owner="o",
            prompt_field="text",
        )
    raw = msg.SerializeToString()
    engine = _Engine()
    router = SimpleNamespace(pick=lambda key, ids: engine, find=lambda rid: None, engines={"w0": engine})
    hub = FrontendHub(ControlConfig(model_dir=Path(".")), router, reports_pb.ServerInfo)  # type: ignore[arg-type]
    link = _Link(1, fe_pb.FrontendHello(), SimpleNamespace(closed=True), None)  # type: ignore[arg-type]
    best = float("inf")
    for _ in range(7):
        engine.submitted.clear()
        started = time.process_time()
        hub._apply(link, fe_pb.FrontendMessage.FromString(raw))
        best = min(best, time.process_time() - started)
    assert len(engine.submitted) == ARRIVALS
    return best / ARRIVALS * 1e6


async def frontend_per_call(properties: int) -> tuple[float, float]:
    """(CPU µs, JSON reads) per call of a schema compiled already."""
    tokenizer = (resolve_model("embedded") / "tokenizer.json").read_text(encoding="utf-8")
    compiler = GrammarCompiler("llguidance", lambda: tokenizer, 1024, {0}, 30.0)
    raw = gen_pb.GenerateRequest(text="hi", sampling=sampling(properties)).SerializeToString()
    reads = 0
    loads = nesting.loads

    def counted(text: str, limit: int = nesting.MAX_DEPTH) -> object:
        nonlocal reads
        reads += 1
        return loads(text, limit)

    nesting.loads = counted  # type: ignore[assignment]
    try:
        best = float("inf")
        for round_ in range(6):
            started = time.process_time()
            for _ in range(CALLS if round_ else 1):  # round 0 compiles it
                inp = client_codec.generate_input_from_proto(gen_pb.GenerateRequest.FromString(raw))
                assert inp.params.sampler.grammar is not None
                await compiler.check(inp.params.sampler.grammar, "sampling.json_schema")
            if round_:
                best = min(best, time.process_time() - started)
            else:
                reads = 0
    finally:
        nesting.loads = loads  # type: ignore[assignment]
        compiler.close()
    return best / CALLS * 1e6, reads / (5 * CALLS)


def main() -> None:
    for properties in (None, 20, 500):
        label = "plain" if properties is None else f"schema of {properties} properties"
        print(f"core, per arrival, {label}: {core_us_per_arrival(properties):.1f} µs")
    for properties in (20, 500, 5000):
        size = len(schema(properties))
        cpu, reads = asyncio.run(frontend_per_call(properties))
        print(
            f"frontend, per call, schema of {size} bytes compiled already: {cpu:.1f} µs, {reads:g} JSON reads"
        )


if __name__ == "__main__":
    main()
