"""The report of `stepwise bench`: per-request samples in, serving statistics out (SGLang's
`bench_serving` figures), as a flat dict that prints as text or JSON.

Statistics cover the completed requests only; refused calls are counted by status code.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TypedDict

OK = "OK"


@dataclass(slots=True)
class Sample:
    """One request as the client saw it; times in seconds, `start` since the run began."""

    prompt_tokens: int = 0
    max_new_tokens: int = 0
    cached_tokens: int = 0  # usage.cached_tokens of its Finished event
    rid: str = ""  # the request id it was sent with ("": the server named it)
    usage_prompt_tokens: int = 0  # usage.prompt_tokens of its Finished event: what the server admitted
    usage_completion_tokens: int = 0  # usage.completion_tokens of its Finished event
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)  # gaps between token-bearing chunks
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each token-bearing chunk
    ok: bool = False  # it finished, and not by an abort
    aborted: bool = False  # it finished by an abort
    refused: str = ""  # the status code's name when the call ended in a gRPC error

    @property
    def status(self) -> str:
        """OK, the refusing status code, ABORTED (finished by an abort) or INCOMPLETE (no Finished)."""
        if self.ok:
            return OK
        return self.refused or ("ABORTED" if self.aborted else "INCOMPLETE")

    def token_times(self) -> list[tuple[float, int]]:
        """(seconds since the run began, tokens) for each token-bearing chunk."""
        at = self.start + self.ttft
        times = [(at, self.chunk_tokens[0])] if self.chunk_tokens else []
        for gap, tokens in zip(self.itls, self.chunk_tokens[1:], strict=False):
            at += gap
            times.append((at, tokens))
        return times


class Report(TypedDict):
    """What `stepwise bench` prints, in this order; latencies in ms."""

    requests: int
    completed: int
    refused: dict[str, int]  # status code name -> calls that ended with it
    aborted: int  # finished by an abort, or the stream ended without a Finished event
    duration_s: float
    concurrency_max: int  # requests in flight at once, at most
    concurrency_mean: float  # SGLang's "concurrency": summed latencies over the duration
    request_throughput: float
    input_throughput_tok_s: float
    output_throughput_tok_s: float
    total_throughput_tok_s: float
    total_input_tokens: int
    total_output_tokens: int
    # From the server's counters (GetServerInfo before and after); None when it does not report them.
    prefix_hit_rate: float | None
    client_hit_rate: float  # from each completed request's usage.cached_tokens
    ttft_mean_ms: float
    ttft_median_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    tpot_median_ms: float
    tpot_p99_ms: float
    itl_mean_ms: float
    itl_median_ms: float
    itl_p99_ms: float
    e2e_latency_mean_ms: float
    e2e_latency_median_ms: float
    e2e_latency_p99_ms: float


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated between ranks as numpy's default; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms_stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [1000 * s for s in seconds]
    return {
        f"{name}_mean_ms": round(statistics.fmean(ms), 3) if ms else 0.0,
        f"{name}_median_ms": round(percentile(ms, 50), 3),
        f"{name}_p99_ms": round(percentile(ms, 99), 3),
    }


def summarize(
    samples: list[Sample], elapsed: float, server_hit_rate: float | None = None, concurrency_max: int = 0
) -> Report:
    """The report: counts over all samples, statistics over the completed ones only."""
    done = [s for s in samples if s.ok]
    elapsed = max(elapsed, 1e-9)
    prompt = sum(s.prompt_tokens for s in done)
    output = sum(s.output_tokens for s in done)
    cached = sum(s.cached_tokens for s in done)
    tpot = [(s.latency - s.ttft) / (s.output_tokens - 1) for s in done if s.output_tokens > 1]
    report: dict[str, Any] = {
        "requests": len(samples),
        "completed": len(done),
        "refused": dict(sorted(Counter(s.refused for s in samples if s.refused).items())),
        "aborted": sum(1 for s in samples if not s.ok and not s.refused),
        "duration_s": round(elapsed, 4),
        "concurrency_max": concurrency_max,
        "concurrency_mean": round(sum(s.latency for s in done) / elapsed, 3),
        "request_throughput": round(len(done) / elapsed, 3),
        "input_throughput_tok_s": round(prompt / elapsed, 2),
        "output_throughput_tok_s": round(output / elapsed, 2),
        "total_throughput_tok_s": round((prompt + output) / elapsed, 2),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "prefix_hit_rate": None if server_hit_rate is None else round(server_hit_rate, 4),
        "client_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        **_ms_stats("ttft", [s.ttft for s in done]),
        **_ms_stats("tpot", tpot),
        **_ms_stats("itl", [x for s in done for x in s.itls]),
        **_ms_stats("e2e_latency", [s.latency for s in done]),
    }
    return report  # type: ignore[return-value]  # the keys are Report's, built in its order


def request_records(samples: list[Sample]) -> list[dict[str, Any]]:
    """Per-request rows for --output-file (seconds, rounded to microseconds)."""
    return [
        {
            "status": s.status,
            "rid": s.rid,
            "prompt_tokens": s.prompt_tokens,
            "max_new_tokens": s.max_new_tokens,
            "output_tokens": s.output_tokens,
            "cached_tokens": s.cached_tokens,
            "usage_prompt_tokens": s.usage_prompt_tokens,
            "usage_completion_tokens": s.usage_completion_tokens,
            "start_s": round(s.start, 6),
            "ttft_s": round(s.ttft, 6),
            "latency_s": round(s.latency, 6),
            "itls_s": [round(x, 6) for x in s.itls],
            "chunk_tokens": s.chunk_tokens,
        }
        for s in samples
    ]


def render(report: Report) -> str:
    """One `key  value` line per entry; "refused" as `CODE count, ...` or `none`; None as `n/a`."""
    width = max(len(k) for k in report)
    return "\n".join(f"{k:<{width}}  {_render_value(v)}" for k, v in report.items())


def _render_value(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{code} {count}" for code, count in value.items()) or "none"
    return "n/a" if value is None else str(value)
