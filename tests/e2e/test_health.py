"""Health follows worker attachment; reflection lists the services; `up` leaves no orphans."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from tests.e2e.conftest import CONTROL_BASE
from tests.processes import ready_file_sync

pytestmark = pytest.mark.timeout(180)


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "stepwise.cli", *args])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        return int(reply.status)


async def _wait_status(address: str, want: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (status := await _status(address)) != want:
        assert time.monotonic() < deadline, f"health stayed {status}, wanted {want}"
        await asyncio.sleep(0.1)


async def test_health_follows_workers_and_reflection_lists_services(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    control = _spawn("control", *CONTROL_BASE, "--ready-file", str(ready))
    worker = None
    try:
        ports = ready_file_sync(ready, control, 60, "control plane")
        address = f"127.0.0.1:{ports['port']}"
        assert await _status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        worker = _spawn("worker", "--control", f"127.0.0.1:{ports['worker_port']}", "--log-level", "warning")
        await _wait_status(address, health_pb2.HealthCheckResponse.SERVING)
        for version in ("v1alpha", "v1"):
            services = await _reflected_services(address, version)
            # Every name that answers, reflection's own two included, and each one described.
            assert {"stepwise.v1.Generation", "grpc.reflection.v1.ServerReflection"} <= services
            assert "grpc.reflection.v1alpha.ServerReflection" in services
            for name in services:
                described = await _reflect(address, version, file_containing_symbol=name)
                assert described.file_descriptor_response.file_descriptor_proto, name
            described = await _reflect(address, version, file_containing_symbol="stepwise.v1.Generation")
            assert described.file_descriptor_response.file_descriptor_proto, described
            worker_port = f"127.0.0.1:{ports['worker_port']}"
            assert "stepwise.v1.WorkerLink" in await _reflected_services(worker_port, version)
        _stop(worker)
        await _wait_status(address, health_pb2.HealthCheckResponse.NOT_SERVING)
    finally:
        if worker is not None:
            _stop(worker)
        _stop(control)


async def _reflect(address: str, version: str, **request: str) -> reflection_pb2.ServerReflectionResponse:
    """One reflection request under `grpc.reflection.VERSION` (the messages are the same on the wire
    in v1 and v1alpha, so v1alpha's classes speak both)."""
    async with grpc.aio.insecure_channel(address) as channel:
        info = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        async for reply in info(iter([reflection_pb2.ServerReflectionRequest(**request)])):
            return reply  # type: ignore[no-any-return]
    raise AssertionError("no reflection reply")


async def _reflected_services(address: str, version: str = "v1alpha") -> set[str]:
    reply = await _reflect(address, version, list_services="")
    return {s.name for s in reply.list_services_response.service}


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    )
    return [int(x) for x in out.stdout.split()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_up_leaves_no_child_behind(sig: signal.Signals) -> None:
    """SIGTERM stops the children cleanly; even SIGKILL of `up` takes them down (PR_SET_PDEATHSIG)."""
    up = subprocess.Popen(
        [sys.executable, "-m", "stepwise.cli", "up", *CONTROL_BASE, "--workers", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    children: list[int] = []
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        assert "client address 127.0.0.1:" in line, line
        children = _children(up.pid)
        assert len(children) == 3
        up.send_signal(sig)
        assert up.wait(30) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in children:
            assert not _alive(pid), f"child {pid} outlived `stepwise up`"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead; it only waits for its parent (gone) to be reaped by init.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


async def test_at_max_concurrent_streams_only_generate_is_refused(start_control) -> None:
    """The bound counts Generate calls: health probes, GetServerInfo and Abort always answer."""
    from clients.client import StepwiseClient, generate_request, sampling_params

    plane = await start_control("--max-concurrent-streams", "4")
    plane.add_worker("w0", "--sim-cost", "0.01,0,0")
    await plane.wait_workers(1)
    sampling = sampling_params(max_new_tokens=100_000, ignore_eos=True)
    async with StepwiseClient(plane.address) as client:
        streams = [client.stream(generate_request([5, 6, 7], sampling, f"s{i}")) for i in range(4)]
        try:
            for stream in streams:
                await stream.read()  # type: ignore[attr-defined]
            checks = await asyncio.gather(*(_status(plane.address) for _ in range(50)))
            assert checks == [health_pb2.HealthCheckResponse.SERVING] * 50
            infos = await asyncio.gather(*(client.server_info() for _ in range(20)))
            assert all(len(info.workers) == 1 for info in infos)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.generate([5, 6, 7], max_new_tokens=2)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-concurrent-streams" in (refused.value.details() or "")
            assert await client.abort("s0")
        finally:
            for stream in streams:
                stream.cancel()  # type: ignore[attr-defined]
        # A slot freed is a slot taken again.
        deadline = time.monotonic() + 10
        while True:
            try:
                gen = await client.generate([5, 6, 7], max_new_tokens=2, ignore_eos=True)
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                await asyncio.sleep(0.05)
        assert len(gen.token_ids) == 2
