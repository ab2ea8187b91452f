"""Stop-string matching cost: memory to build a matcher for one long stop string, and time per
character fed with 100,000 stop strings. Prints figures; not a test.

    python bench/bench_stop_matcher.py
"""

from __future__ import annotations

import time
import tracemalloc

from control_plane.frontend.detokenize import StopMatcher


def main() -> None:
    tracemalloc.start()
    StopMatcher(["x" * 30_000])
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    stops = [f"s{i}" for i in range(100_000)]
    started = time.perf_counter()
    matcher = StopMatcher(stops)
    build = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(200):
        matcher.feed("a")
    feed_ms = (time.perf_counter() - started) / 200 * 1000
    print(f"30k-char stop: peak {peak:.1f} MiB; 100k stops: build {build:.2f} s, feed {feed_ms:.3f} ms/char")


if __name__ == "__main__":
    main()
