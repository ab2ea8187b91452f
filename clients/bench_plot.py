"""`stepwise bench --plot PATH.png`: latency CDFs (TTFT, ITL, end to end) and output throughput
over time, one PNG.

matplotlib is an optional extra (`pip install 'stepwise[plot]'`): it is imported only here, and
only when a plot is asked for.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING

from clients.bench_report import Sample

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MISSING = "--plot needs matplotlib, which is not installed: pip install 'stepwise[plot]'"


def available() -> bool:
    """Whether matplotlib can be imported (checked before the run, so a missing extra costs no load)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # a module entry set to None (how tests hide it)
        return False


def throughput_buckets(samples: list[Sample], bucket_s: float = 1.0) -> list[float]:
    """Output tokens/s in each `bucket_s` bucket since the run began, by chunk arrival time."""
    times = [t for s in samples if s.ok for t in s.token_times()]
    if not times:
        return []
    buckets = [0.0] * (math.floor(max(at for at, _ in times) / bucket_s) + 1)
    for at, tokens in times:
        buckets[math.floor(at / bucket_s)] += tokens / bucket_s
    return buckets


def plot(samples: list[Sample], path: Path, title: str = "stepwise bench") -> None:
    """Write the figure to `path` (PNG); completed requests only."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    done = [s for s in samples if s.ok]
    figure = Figure(figsize=(11, 8), layout="constrained")
    figure.suptitle(f"{title}: {len(done)} of {len(samples)} requests completed")
    ttft, itl, e2e, rate = figure.subplots(2, 2).flat
    _cdf(ttft, "TTFT", [s.ttft for s in done])
    _cdf(itl, "ITL", [x for s in done for x in s.itls])
    _cdf(e2e, "end-to-end latency", [s.latency for s in done])
    buckets = throughput_buckets(samples)
    rate.bar(range(len(buckets)), buckets, width=1.0, align="edge")
    rate.set(title="output throughput", xlabel="seconds since start", ylabel="tokens/s")
    figure.savefig(path, format="png")


def _cdf(axes: Axes, name: str, seconds: list[float]) -> None:
    ms = sorted(1000 * s for s in seconds)
    fractions = [(i + 1) / len(ms) for i in range(len(ms))]
    axes.step(ms, fractions, where="post")
    axes.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
    axes.grid(alpha=0.3)
