"""A worker the control plane drops is told why, and searches again (real processes).

A worker that misses its step deadline (here: SIGSTOPped past `--worker-step-timeout`, then
SIGCONTed) is dropped: its requests continue elsewhere. It must not be told "Shutdown", which a
worker obeys by exiting 0 for good (under `Restart=on-failure`, or anything that restarts only
failures, it would never come back). It is told it was dropped and why, and it searches again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clients.client import StepwiseClient
from tests.e2e.conftest import WORKER_BASE
from tests.polling import until

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


async def _attached(address: str, worker_id: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    async with StepwiseClient(address) as client:
        while time.monotonic() < deadline:
            workers = [w.worker_id for w in (await client.server_info()).workers]
            if worker_id in workers:
                return True
            await asyncio.sleep(0.1)
    return False


async def test_a_worker_dropped_for_a_step_timeout_is_told_why_and_comes_back(
    start_control, tmp_path: Path
) -> None:
    plane = await start_control("--worker-step-timeout", "1", "--worker-step-timeout-per-token", "0")
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        flags = ["--log-level", "info", "--backend", "sim", "--sim-cost", "0.01,0,0", "--worker-id", "w0"]
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stepwise.cli",
                "worker",
                *WORKER_BASE,
                *flags,
                "--control",
                plane.worker_address,
            ],
            cwd=ROOT,
            stderr=log,
        )
    plane.procs.append(worker)  # stopped with the plane, also when the test fails
    assert await _attached(plane.address, "w0", 60)
    async with StepwiseClient(plane.address) as client:
        call = asyncio.create_task(client.generate([5, 6, 7], max_new_tokens=400, ignore_eos=True))

        async def running() -> bool:
            return (await client.server_info()).running > 0

        # It runs (400 steps of 10 ms: for 4 s at least), so the worker holds a plan when it stops.
        # A fixed pause instead left the stop to land before the call reached a loaded plane.
        await until(running, 30, "the call running on w0", every_s=0.02)
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(3.0)  # past the 1 s step deadline: the control plane drops it
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        result = await asyncio.wait_for(call, 60)
    # No other worker: the call ends with an explicit abort that says the worker was lost.
    assert result.finish_reason == "abort", result
    assert worker.poll() is None, "the dropped worker exited instead of searching again"
    assert await _attached(plane.address, "w0", 30), "the dropped worker did not attach again"
    assert worker.poll() is None
    text = log_path.read_text()
    assert "control plane is shutting down" not in text
    assert "dropped" in text and "no result for step" in text, text[-2000:]
