"""`stepwise bench`: a load generator with serving metrics, after SGLang's `bench_serving`.

Builds a seeded workload (`--dataset random | generated-shared-prefix | uniform`, clients/datasets.py),
sends it with `--max-concurrency` requests in flight and/or Poisson arrivals at `--request-rate`; or
sends a trace (`--dataset trace FILE`, clients/traces.py) at its own arrival times, the workload
`stepwise simulate FILE` runs with the same trace flags,
and reports TTFT, TPOT, ITL and end-to-end latency (mean, median, p99), request and token
throughput, the concurrency reached, and the prefix-cache hit rate from the server's counters
(clients/bench_report.py), as text or one JSON object; `--output-file` adds per-request records and
the run's parameters, `--plot` draws latency CDFs and throughput over time (clients/bench_plot.py).

Calls the control plane refuses (RESOURCE_EXHAUSTED when its queue is full, ...) are counted by
status code under "refused", never fatal; the statistics cover the completed requests only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import grpc

from clients import bench_plot, datasets
from clients import traces as client_traces
from clients.bench_report import Report, Sample, render, request_records, summarize
from clients.client import (
    StepwiseClient,
    add_connection_arguments,
    client_from_args,
    generate_request,
    sampling_params,
)
from clients.datasets import BenchRequest
from clients.errors import RoutineError
from flagtypes import INT32_MAX, SEED, Float, Int, IntPair
from flagtypes.table import SWITCH, Flag, Flags
from protos.stepwise.v1 import generation_pb2 as gen_pb

__all__ = ["Report", "Sample", "add_arguments", "render", "run", "summarize", "workload"]

DATASETS = ("uniform", "random", "generated-shared-prefix", "trace")
# Bounds of the workload's flags: a typo must not build a workload that fills the memory.
MAX_REQUESTS = 1_000_000
MAX_LEN = 1 << 20
LENGTHS = IntPair(1, MAX_LEN)
SECRET_FLAGS = ("api_key",)  # never written to --output-file


_LOAD = Flags(
    None,
    (
        Flag(
            "--num-prompts", Int(1, MAX_REQUESTS), aliases=("--requests",), dest="requests", default=64,
            help="generations to send (generated-shared-prefix sends groups x prompts per group)",
        ),
        Flag(
            "--max-concurrency", Int(0, MAX_REQUESTS), aliases=("--concurrency",), dest="concurrency",
            default=16, help="requests in flight at most (0: no limit)",
        ),
        Flag(
            "--request-rate", Float(0.0, math.inf), aliases=("--rate",), dest="rate", default=math.inf,
            help="Poisson arrivals per second (inf or 0: all at once)",
        ),
    ),
)  # fmt: skip
_TOKENS, _GROUPS = Int(1, MAX_LEN), Int(1, MAX_REQUESTS)
_DATASET = Flags(
    None,
    (
        Flag(
            "--dataset", choices=DATASETS, default="uniform", help="the workload (SGLang's names, or trace)"
        ),
        Flag(
            "trace",
            Path,
            nargs="?",
            metavar="FILE",
            help="trace: the requests, sent at their arrival times (ignoring --max-concurrency and "
            "--request-rate) with their prompts and output lengths, as `stepwise simulate FILE` runs them "
            "with the same --vocab (its --vocab-size) and trace flags",
        ),
        Flag("--prompt-len", LENGTHS, default=(32, 256), help="uniform: min,max prompt tokens"),
        Flag("--output-len", LENGTHS, default=(16, 128), help="uniform: min,max new tokens"),
        Flag(
            "--shared-prefix",
            Int(0, MAX_LEN),
            default=0,
            help="uniform: tokens shared by each group's prompts",
        ),
        Flag("--groups", _GROUPS, default=4, help="uniform: prefix groups (with --shared-prefix)"),
        Flag("--random-input-len", _TOKENS, default=256, help="random: prompt tokens at most"),
        Flag("--random-output-len", _TOKENS, default=128, help="random: new tokens at most"),
        Flag(
            "--random-range-ratio",
            Float(0.0, 1.0),
            default=1.0,
            help="random: lengths from ratio x len to len",
        ),
        Flag("--gsp-num-groups", _GROUPS, default=4, help="generated-shared-prefix: groups"),
        Flag(
            "--gsp-prompts-per-group", _GROUPS, default=8, help="generated-shared-prefix: prompts per group"
        ),
        Flag(
            "--gsp-system-prompt-len",
            Int(0, MAX_LEN),
            default=256,
            help="generated-shared-prefix: prefix tokens",
        ),
        Flag("--gsp-question-len", _TOKENS, default=32, help="generated-shared-prefix: question tokens"),
        Flag("--gsp-output-len", _TOKENS, default=64, help="generated-shared-prefix: new tokens"),
        Flag("--vocab", Int(4, INT32_MAX), default=1000, help="token ids are drawn from [3, vocab)"),
    ),
)
_REPORT = Flags(
    None,
    (
        Flag("--seed", SEED, default=0, help="seed of the prompts and arrival times"),
        Flag("--json", SWITCH, help="print the report as one JSON object"),
        Flag("--quiet", SWITCH, help="no progress bar"),
        Flag(
            "--output-file", Path, metavar="PATH",
            help="write the report, per-request records and the run's parameters as JSON",
        ),
        Flag(
            "--plot", Path, metavar="PATH.png",
            help="draw latency CDFs and throughput over time (needs the `plot` extra: matplotlib)",
        ),
    ),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    _LOAD.add_to(parser)
    _DATASET.add_to(parser)
    client_traces.add_arguments(parser)
    _REPORT.add_to(parser)


def _complete(ns: argparse.Namespace) -> argparse.Namespace:
    """`ns` with every flag this command knows: namespaces built by hand (benchmarks, tests) may
    carry only the flags they change."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return argparse.Namespace(**{**vars(parser.parse_args([])), **vars(ns)})


def workload(ns: argparse.Namespace) -> list[BenchRequest]:
    """The requests `--dataset` and its flags describe; deterministic in --seed."""
    if ns.dataset == "trace":
        return trace_workload(ns)
    if ns.dataset == "random":
        return datasets.random_requests(
            ns.requests, ns.random_input_len, ns.random_output_len, ns.random_range_ratio, ns.vocab, ns.seed
        )
    if ns.dataset == "generated-shared-prefix":
        return datasets.shared_prefix_requests(
            ns.gsp_num_groups, ns.gsp_prompts_per_group, ns.gsp_system_prompt_len,
            ns.gsp_question_len, ns.gsp_output_len, ns.vocab, ns.seed,
        )  # fmt: skip
    requests = datasets.uniform_requests(ns.requests, ns.prompt_len, ns.output_len, ns.vocab, ns.seed)
    return _with_shared_prefix(requests, ns.shared_prefix, ns.groups, ns.vocab, ns.seed)


def trace_workload(ns: argparse.Namespace) -> list[BenchRequest]:
    """The trace's requests with their arrival times; each generates exactly the tokens it does in
    `stepwise simulate` (EOS ignored, max_new_tokens = that length). A bad trace is a TraceError."""
    if ns.trace is None:
        raise client_traces.TraceError("--dataset trace: wants the trace FILE")
    try:
        entries = client_traces.read_trace(ns, ns.vocab)
    except OSError as exc:
        raise client_traces.TraceError(f"{ns.trace}: cannot read it: {exc.strerror}") from None
    requests = []
    for entry in entries:
        length = entry.output_tokens
        if length is None:
            raise client_traces.TraceError(
                f"{ns.trace}: request {entry.rid!r}: max_new_tokens or output_len: "
                "a live run needs its output length"
            )
        requests.append(
            BenchRequest(
                list(entry.input_ids),
                length,
                rid=entry.rid,
                arrival=entry.arrival,
                routing_key=entry.routing_key,
            )
        )
    return requests


def _with_shared_prefix(
    requests: list[BenchRequest], prefix_len: int, groups: int, vocab: int, seed: int
) -> list[BenchRequest]:
    """Request i gets group i % groups's random prefix of `prefix_len` tokens (none when 0)."""
    if prefix_len <= 0:
        return requests
    groups = max(groups, 1)
    prefixes = [r.prompt_ids for r in datasets.random_requests(groups, prefix_len, 1, 1.0, vocab, seed + 2)]
    return [
        replace(r, prompt_ids=prefixes[i % groups] + r.prompt_ids, group=i % groups)
        for i, r in enumerate(requests)
    ]


# --- sending ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Load:
    """What sending the workload gave: one sample per request, in workload order."""

    samples: list[Sample]
    elapsed: float  # first send to last completion
    concurrency_max: int


async def send(
    client: StepwiseClient,
    requests: list[BenchRequest],
    concurrency: int,
    rate: float,
    seed: int,
    on_done: Callable[[], None] = lambda: None,
) -> Load:
    """Send every request with at most `concurrency` in flight (0: no limit), arrivals Poisson at
    `rate` per second (inf or 0: all at once); `on_done` after each request ends. Requests with an
    `arrival` (a trace's) are sent at that offset from the start instead, none held back."""
    timed = any(r.arrival is not None for r in requests)
    if timed:
        concurrency, rate = 0, math.inf
    gate = asyncio.Semaphore(concurrency if concurrency > 0 else max(len(requests), 1))
    arrivals = random.Random(seed + 1)
    paced = 0 < rate < math.inf
    in_flight = peak = 0
    started = time.perf_counter()

    async def one(request: BenchRequest) -> Sample:
        nonlocal in_flight, peak
        async with gate:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await _one(client, request, started)
            finally:
                in_flight -= 1
                on_done()

    tasks = []
    for i, request in enumerate(requests):
        if paced and i:
            await asyncio.sleep(arrivals.expovariate(rate))
        elif request.arrival is not None:
            await asyncio.sleep(max(0.0, started + request.arrival - time.perf_counter()))
        tasks.append(asyncio.create_task(one(request)))
    samples = await asyncio.gather(*tasks)
    return Load(list(samples), time.perf_counter() - started, peak)


async def _one(client: StepwiseClient, request: BenchRequest, started: float) -> Sample:
    """One generation's timings; a call that ends in a gRPC error comes back with `refused` set."""
    sample = Sample(
        prompt_tokens=len(request.prompt_ids), max_new_tokens=request.max_new_tokens, rid=request.rid
    )
    params = sampling_params(max_new_tokens=request.max_new_tokens, temperature=0.0, ignore_eos=True)
    call = generate_request(
        request.prompt_ids, params, request_id=request.rid, routing_key=request.routing_key
    )
    start = time.perf_counter()
    sample.start = start - started
    try:
        await _stream(client, call, sample, start)
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
            sample.chunk_tokens.append(len(response.chunk.token_ids))
            sample.output_tokens += len(response.chunk.token_ids)
            last = now
        elif response.WhichOneof("event") == "finished":
            usage = response.finished.usage
            sample.cached_tokens = usage.cached_tokens
            sample.usage_prompt_tokens = usage.prompt_tokens
            sample.usage_completion_tokens = usage.completion_tokens
            sample.aborted = response.finished.reason == gen_pb.FINISH_REASON_ABORT
            sample.ok = not sample.aborted


# --- the server's prefix-cache counters -----------------------------------------------------------


async def server_totals(client: StepwiseClient) -> tuple[int, int] | None:
    """(prompt tokens, cached tokens) the server's workers have admitted so far; None when it
    cannot say. With several control planes behind the address, the one that answers counts."""
    try:
        info = await client.server_info()
    except grpc.aio.AioRpcError:
        return None
    workers = info.workers
    return sum(w.prompt_tokens_total for w in workers), sum(w.cached_tokens_total for w in workers)


def server_hit_rate(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Cached over prompt tokens admitted between the two readings; None without both, or when
    the server admitted no prompt tokens in between (a server that does not count them)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


# --- the command ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _progress(out: TextIO, total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    """A rich progress bar on `out` while the load runs (erased after); a no-op when disabled."""
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(file=out), transient=True) as bar:
        task = bar.add_task("requests", total=total)
        yield lambda: bar.advance(task)


async def run(ns: argparse.Namespace, out: TextIO = sys.stdout) -> Report:
    """Send the load, print the report (text, or JSON with --json) to `out`, write --output-file
    and --plot, and return the report."""
    ns = _complete(ns)
    if ns.plot is not None and not bench_plot.available():
        raise RoutineError(bench_plot.MISSING)
    try:
        requests = workload(ns)
    except client_traces.TraceError as exc:
        raise RoutineError(str(exc)) from None
    show_progress = not (ns.json or ns.quiet) and out.isatty()
    async with client_from_args(ns) as client:
        await client.wait_ready(ns.wait)
        before = await server_totals(client)
        with _progress(out, len(requests), show_progress) as advance:
            load = await send(client, requests, ns.concurrency, ns.rate, ns.seed, advance)
        after = await server_totals(client)
    report = summarize(load.samples, load.elapsed, server_hit_rate(before, after), load.concurrency_max)
    if ns.output_file is not None:
        ns.output_file.write_text(json.dumps(output_document(ns, report, load.samples), indent=1) + "\n")
    if ns.plot is not None:
        bench_plot.plot(load.samples, ns.plot, title=f"stepwise bench, {ns.dataset}")
    out.write((json.dumps(report) if ns.json else render(report)) + "\n")
    return report


def output_document(ns: argparse.Namespace, report: Report, samples: list[Sample]) -> dict[str, Any]:
    """--output-file's JSON: the run's parameters, the report and one record per request."""
    return {"parameters": parameters(ns), "report": report, "requests": request_records(samples)}


def parameters(ns: argparse.Namespace) -> dict[str, Any]:
    """The flags as strict JSON values (paths as text, inf as "inf"), secrets left out."""
    return {k: _json_value(v) for k, v in sorted(vars(ns).items()) if k not in SECRET_FLAGS}


def _json_value(value: object) -> object:
    if isinstance(value, tuple):  # --prompt-len and --output-len: [MIN, MAX]
        return [_json_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
