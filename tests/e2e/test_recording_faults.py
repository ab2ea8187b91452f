"""A recording that cannot be written never stops serving (`--record DIR`, real processes).

- A directory that cannot be written is refused at start: one line, exit 2, before any worker
  attaches (not a control plane that starts and then fails every worker's Connect).
- A write that fails mid-run (a full disk; here the file-size limit of the process, which makes
  writes fail the same way) is logged once, the recording stops, and every request is served by
  the same, still attached worker.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clients.client import StepwiseClient
from tests.e2e.conftest import CONTROL_BASE, WORKER_BASE
from tests.processes import ready_file

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
# Bytes the control plane may write to any one file: the recording's header and a few hundred steps.
FILE_SIZE_LIMIT = 24 * 1024


def test_an_unwritable_record_directory_is_refused_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    done = subprocess.run(
        [sys.executable, "-m", "stepwise.cli", "control", *CONTROL_BASE, "--record", str(blocker / "rec")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2, done.stderr[-800:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "--record" in lines[0] and str(blocker / "rec") in lines[0]


def _with_file_size_limit(limit: int, *args: str) -> list[str]:
    """`stepwise ARGS` run under RLIMIT_FSIZE: set in a small Python that then execs the command
    (no preexec_fn, which is unsafe in a process with threads). CPython ignores SIGXFSZ, so a write
    past the limit fails with EFBIG, as one on a full disk fails with ENOSPC."""
    program = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
        "os.execv(sys.executable, [sys.executable, '-m', 'stepwise.cli', *sys.argv[1:]])"
    )
    return [sys.executable, "-c", program, *args]


async def test_a_write_error_mid_run_stops_the_recording_and_serving_goes_on(tmp_path: Path) -> None:
    record = tmp_path / "rec"
    ready = tmp_path / "ready.json"
    control_log = (tmp_path / "control.log").open("wb")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        recorded = ["--record", str(record), "--ready-file", str(ready)]
        control = subprocess.Popen(
            _with_file_size_limit(FILE_SIZE_LIMIT, "control", *CONTROL_BASE, *recorded),
            cwd=ROOT,
            stderr=control_log,
        )
        procs.append(control)
        ports = await ready_file(ready, control, 60, "control plane")
        address = f"127.0.0.1:{ports['port']}"
        sim = ["--backend", "sim", "--sim-cost", "0.001,0,0", "--worker-id", "w0"]
        sim += ["--control", f"127.0.0.1:{ports['worker_port']}"]
        worker = subprocess.Popen(
            [sys.executable, "-m", "stepwise.cli", "worker", *WORKER_BASE, *sim],
            cwd=ROOT,
            env={**os.environ},
        )
        procs.append(worker)
        async with StepwiseClient(address) as client:
            deadline = time.monotonic() + 60
            while len((await client.server_info()).workers) != 1:
                assert time.monotonic() < deadline, "the worker did not attach"
                await asyncio.sleep(0.05)

            async def one(i: int) -> tuple[str, int]:
                result = await client.generate([5 + i, 6, 7, 8], max_new_tokens=40, ignore_eos=True)
                return result.finish_reason, len(result.token_ids)

            results = []
            for batch in range(6):
                results += await asyncio.gather(*(one(8 * batch + i) for i in range(8)))
            info = await client.server_info()
        assert results == [("length", 40)] * 48
        # The same worker served everything: it was never dropped and re-attached.
        assert [w.worker_id for w in info.workers] == ["w0"]
        assert worker.poll() is None
        assert max(p.stat().st_size for p in record.iterdir()) >= FILE_SIZE_LIMIT // 2, (
            "the limit was never hit"
        )
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        control_log.close()
    log = (tmp_path / "control.log").read_text()
    stopped = [line for line in log.splitlines() if "recording stopped" in line]
    assert len(stopped) == 1, log[-3000:]
    assert "step loop fault" not in log
