"""Run `python -m stepwise.cli` as a person would: a subprocess, a clean STEPWISE_* environment."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STEPWISE_")}
    return {**clean, **(extra or {})}


def run_cli(args: Sequence[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepwise.cli", *args],
        cwd=ROOT,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


async def run_cli_async(args: Sequence[str]) -> tuple[int, str, str]:
    """run_cli without blocking the event loop (the in-test server must keep answering)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "stepwise.cli",
        *args,
        cwd=ROOT,
        env=_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def assert_one_line(code: int, stderr: str, *names: str) -> str:
    """Exit 2 and exactly one non-empty stderr line that mentions every one of `names`."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), stderr
    for name in names:
        assert name in lines[0], lines[0]
    assert code == 2, (code, stderr)
    return lines[0]


def closed_pipe() -> int:
    """The write end of a pipe whose reader is already gone: every write to it fails with EPIPE,
    as `| head -1` does once head has read its line (without the race of when it reads)."""
    read, write = os.pipe()
    os.close(read)
    return write


def run_cli_into_closed_pipe(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """run_cli with stdout a pipe nobody reads (stderr captured)."""
    stdout = closed_pipe()
    try:
        return subprocess.run(
            [sys.executable, "-m", "stepwise.cli", *args],
            cwd=ROOT,
            env=_env(),
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    finally:
        os.close(stdout)


async def run_cli_into_closed_pipe_async(args: Sequence[str]) -> tuple[int, str]:
    """run_cli_into_closed_pipe without blocking the event loop: (exit code, stderr)."""
    stdout = closed_pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stepwise.cli", *args, cwd=ROOT, env=_env(), stdout=stdout,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
    finally:
        os.close(stdout)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, err.decode()
