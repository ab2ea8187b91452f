"""`stepwise up` supervises: a killed worker is restarted and its streams finish exactly; several
control planes share the workers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from clients.client import Generation, StepwiseClient, collect, generate_request, sampling_params
from stepwise.up import stop_processes
from tests.e2e.test_faults import _stream
from tests.e2e.test_generate import _encode_all
from tests.processes import ready_file

pytestmark = pytest.mark.timeout(300)

STREAMS = 32
MAX_NEW = 100


class Up:
    """`stepwise up ...` as a child process, and the children it started (found through /proc)."""

    def __init__(self, proc: subprocess.Popen[bytes], ready: dict[str, str]) -> None:
        self.proc = proc
        self.address = ready["address"]

    def child_pid(self, needle: str) -> int | None:
        """The pid of this `up`'s child whose command line contains `needle`."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and needle in cmdline:
                return int(entry.name)
        return None


@pytest.fixture
async def start_up(tmp_path: Path) -> AsyncIterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    async def start(*flags: str) -> Up:
        ready = tmp_path / f"up-{len(procs)}.json"
        args = ["up", "--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]
        args += [*flags, "--ready-file", str(ready)]
        proc = subprocess.Popen([sys.executable, "-m", "stepwise.cli", *args])
        procs.append(proc)
        return Up(proc, await ready_file(ready, proc, 120, "stepwise up"))

    try:
        yield start
    finally:
        stop_processes(procs, timeout=20)


async def _run(
    client: StepwiseClient, prompts: list[list[int]], on_progress: Callable[[], None] | None = None
) -> list[Generation]:
    """Stream every prompt at once; `on_progress` runs once every stream has 20 tokens."""
    progress = [0] * len(prompts)
    tasks = [asyncio.create_task(_stream(client, ids, progress, i, MAX_NEW)) for i, ids in enumerate(prompts)]
    if on_progress is not None:
        while min(progress) < 20 and not all(t.done() for t in tasks):
            await asyncio.sleep(0.005)
        on_progress()
    return await asyncio.gather(*tasks)


@pytest.mark.slow
async def test_a_killed_worker_is_restarted_and_every_stream_ends_with_the_fault_free_tokens(
    start_up, model_dir: Path
) -> None:
    up = await start_up("--workers", "2")
    prompts, _eos = _encode_all(model_dir)
    prompts = [prompts[i % len(prompts)] + [10 + i] for i in range(STREAMS)]
    async with StepwiseClient(up.address) as client:
        fault_free = await _run(client, prompts)
        victim = up.child_pid("--worker-id worker-1")
        assert victim is not None
        faulted = await _run(client, prompts, on_progress=lambda: os.kill(victim, signal.SIGKILL))
        for clean, gen in zip(fault_free, faulted, strict=True):
            assert (gen.finish_reason, gen.completion_tokens) == ("length", MAX_NEW), gen.finish_message
            assert gen.token_ids == clean.token_ids
        # `up` starts worker-1 again, and it attaches again.
        deadline = time.monotonic() + 30
        while True:
            ids = sorted(w.worker_id for w in (await client.server_info()).workers)
            restarted = up.child_pid("--worker-id worker-1")
            if ids == ["worker-0", "worker-1"] and restarted not in (None, victim):
                break
            assert time.monotonic() < deadline, f"worker-1 was not restarted (attached: {ids})"
            await asyncio.sleep(0.1)
    assert up.proc.poll() is None  # the stack kept running


@pytest.mark.slow
async def test_up_with_two_control_planes_spreads_workers_and_calls(start_up) -> None:
    up = await start_up("--control-planes", "2", "--workers", "4", "--backend", "sim")
    addresses = up.address.split(",")
    assert len(addresses) == 2
    deadline = time.monotonic() + 30
    while True:
        counts = []
        for address in addresses:
            async with StepwiseClient(address) as one:
                counts.append(len((await one.server_info()).workers))
        if sorted(counts) == [2, 2]:
            break
        assert time.monotonic() < deadline, f"workers did not spread evenly: {counts}"
        await asyncio.sleep(0.2)
    async with StepwiseClient(up.address) as client:  # round robin over both
        gens = await asyncio.gather(*(client.generate(f"hello {i}", max_new_tokens=8) for i in range(16)))
    assert all(g.finish_reason in ("stop", "length") and g.token_ids for g in gens)


async def test_sighup_to_up_rereads_its_control_planes_tenant_file(start_up, tmp_path: Path) -> None:
    """deploy.md's `kill -HUP` for a stack `up` started: `up` passes the signal on to its control
    planes (by default a SIGHUP would end `up` and leave its children running) and keeps running."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("[defaults]\n")
    up = await start_up("--backend", "sim", "--tenants", str(tenants))
    async with StepwiseClient(up.address) as client:

        async def call(i: int) -> grpc.aio.AioRpcError | None:
            request = generate_request([5, 6, 7], sampling_params(max_new_tokens=1), f"r{i}", tenant="t")
            try:
                await asyncio.wait_for(collect(client.stream(request)), 30)
            except grpc.aio.AioRpcError as exc:
                return exc
            return None

        assert [await call(i) for i in range(3)] == [None, None, None]
        # A bucket that one call empties for the next 3,000 seconds.
        tenants.write_text("[defaults]\ntoken_rate = 0.001\n")
        up.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        i = 3
        while (refused := await call(i)) is None:
            assert up.proc.poll() is None, "SIGHUP ended up"
            assert time.monotonic() < deadline, "the control plane did not reread its tenant file"
            i += 1
            await asyncio.sleep(0.05)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (refused.details() or "").startswith("token_rate: "), refused.details()
    assert up.proc.poll() is None
