"""Starting `stepwise` children for tests and benches: wait for a child's --ready-file.

Every `stepwise control`, `gateway` and `up` writes its ports (and pids) to its --ready-file once it
accepts; the tests' fixtures (tests/e2e/conftest.py and the e2e files that start their own stacks)
and the benches (bench/bench_control.py, bench/bench_grammar_stall.py) wait for that file the same
way, here. Stopping them is `stepwise.up.stop_processes`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any


class DidNotStart(RuntimeError):
    """The child exited, or wrote no ready file in time."""


def _check(
    proc: subprocess.Popen[bytes], deadline: float, timeout_s: float, what: str, log: Path | None
) -> None:
    if proc.poll() is not None:
        problem = f"{what} exited with {proc.returncode}"
    elif time.monotonic() > deadline:
        problem = f"{what} did not start within {timeout_s:g} s"
    else:
        return
    tail = f":\n{log.read_text(errors='replace')[-3000:]}" if log is not None and log.exists() else ""
    raise DidNotStart(problem + tail)


async def ready_file(
    path: Path, proc: subprocess.Popen[bytes], timeout_s: float, what: str, *, log: Path | None = None
) -> dict[str, Any]:
    """What `proc` wrote to its --ready-file `path`, once it is there; DidNotStart (with the tail of
    `log`, if given) when `proc` exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        _check(proc, deadline, timeout_s, what, log)
        await asyncio.sleep(0.05)
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def ready_file_sync(
    path: Path, proc: subprocess.Popen[bytes], timeout_s: float, what: str, *, log: Path | None = None
) -> dict[str, Any]:
    """`ready_file` for a caller with no event loop."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        _check(proc, deadline, timeout_s, what, log)
        time.sleep(0.05)
    data: dict[str, Any] = json.loads(path.read_text())
    return data
