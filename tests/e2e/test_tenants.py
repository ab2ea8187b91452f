"""Tenants on real processes: two API keys bound to two tenants, one flooding past its quota. The
flooder's surplus is refused with RESOURCE_EXHAUSTED and a retry-after (429 with Retry-After through
the gateway) while the other tenant's requests all run; a bad tenant file on SIGHUP keeps the table,
a good one takes effect."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from clients.client import StepwiseClient, bearer_metadata, generate_request, sampling_params
from stepwise.up import stop_processes
from tests.e2e.conftest import ControlProcess

pytestmark = pytest.mark.timeout(120)

FLOOD, CALM = "flood-key-for-tests", "calm-key-for-tests"


def key_id(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]


def tenant_file(path: Path, flood_concurrent: int) -> Path:
    path.write_text(
        f"""
[tenants.flood]
keys = ["{key_id(FLOOD)}"]
max_concurrent_requests = {flood_concurrent}

[tenants.calm]
keys = ["{key_id(CALM)}"]
"""
    )
    return path


async def _first(client: StepwiseClient, key: str, rid: str, **fields: object) -> object:
    """Start a long generation; its first response, or the AioRpcError that refused it."""
    request = generate_request([5, 6, 7], sampling_params(max_new_tokens=300, ignore_eos=True), rid)
    for name, value in fields.items():
        setattr(request, name, value)
    call = client.stub.Generate(request, metadata=bearer_metadata(key))
    try:
        await call.read()
    except grpc.aio.AioRpcError as exc:
        return exc
    return call


async def _wait_running(client: StepwiseClient, n: int) -> None:
    deadline = time.monotonic() + 30
    while (await client.server_info()).running + (await client.server_info()).queued < n:
        assert time.monotonic() < deadline, f"{n} requests did not start"
        await asyncio.sleep(0.02)


async def test_a_flooding_tenant_is_refused_with_retry_after_and_the_other_runs(
    start_control, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{FLOOD}\n{CALM}\n")
    tenants = tenant_file(tmp_path / "tenants.toml", flood_concurrent=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    plane: ControlProcess = await start_control(
        "--api-key-file", str(keys), "--tenants", str(tenants), "--metrics-port", str(metrics_port)
    )
    # 20 ms a step: a 300-token request runs for seconds, so the flood's requests overlap.
    plane.add_worker("w0", "--sim-cost", "0.02,0,0")
    await plane.wait_workers(1, api_key=CALM)
    async with StepwiseClient(plane.address, api_key=CALM) as client:
        flood = await asyncio.gather(*(_first(client, FLOOD, f"f{i}") for i in range(6)))
        refused = [r for r in flood if isinstance(r, grpc.aio.AioRpcError)]
        running = [r for r in flood if not isinstance(r, grpc.aio.AioRpcError)]
        assert len(running) == 2 and len(refused) == 4
        for exc in refused:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_concurrent_requests" in (exc.details() or "")
            assert dict(exc.trailing_metadata() or ())["retry-after"] == "1"
        # The other tenant is not disturbed: every one of its calls runs beside the flood.
        calm = await asyncio.gather(*(_first(client, CALM, f"c{i}") for i in range(4)))
        assert not any(isinstance(r, grpc.aio.AioRpcError) for r in calm)
        # A key bound to a tenant may not pass for another.
        forbidden = await _first(client, CALM, "x", tenant="flood")
        assert isinstance(forbidden, grpc.aio.AioRpcError)
        assert forbidden.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (forbidden.details() or "").startswith("tenant: ")

        rows = {t.name: t for t in (await client.server_info()).tenants}
        assert (rows["flood"].requests, rows["flood"].rejected, rows["flood"].concurrent) == (2, 4, 2)
        assert (rows["calm"].requests, rows["calm"].rejected, rows["calm"].concurrent) == (4, 0, 4)
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
        assert 'stepwise:tenant_rejected_total{quota="max_concurrent_requests",tenant="flood"} 4.0' in text
        assert 'stepwise:tenant_requests_total{tenant="calm"} 4.0' in text
        assert 'stepwise:tenant_concurrent_requests{tenant="flood"} 2.0' in text

        # A bad file on SIGHUP: the control plane keeps serving with the table it had.
        tenants.write_text("[tenants.flood]\nmax_concurrent_requests = -1\n")
        plane.control.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.5)
        assert plane.control.poll() is None
        again = await _first(client, FLOOD, "f-bad")
        assert isinstance(again, grpc.aio.AioRpcError)
        assert again.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # A good one takes effect for the next arrival.
        tenant_file(tenants, flood_concurrent=3)
        plane.control.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while isinstance(third := await _first(client, FLOOD, f"f-good-{time.monotonic()}"), Exception):
            assert time.monotonic() < deadline, "the reloaded table did not take effect"
            await asyncio.sleep(0.1)
        for call in [*running, *calm, third]:
            call.cancel()  # type: ignore[attr-defined]


async def test_the_gateway_answers_over_quota_with_429_and_retry_after(start_control, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{FLOOD}\n{CALM}\n")
    tenants = tenant_file(tmp_path / "tenants.toml", flood_concurrent=1)
    plane: ControlProcess = await start_control("--api-key-file", str(keys), "--tenants", str(tenants))
    plane.add_worker("w0", "--sim-cost", "0.02,0,0")
    await plane.wait_workers(1, api_key=CALM)
    ready = tmp_path / "gateway.json"
    args = ["gateway", "--control", plane.address, "--port", "0", "--ready-file", str(ready)]
    gateway = subprocess.Popen([sys.executable, "-m", "stepwise.cli", *args])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert gateway.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}/v1/completions"
        body = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=60) as http:

            async def post(key: str) -> httpx.Response:
                return await http.post(url, json=body, headers={"Authorization": f"Bearer {key}"})

            async with StepwiseClient(plane.address, api_key=CALM) as client:
                first = asyncio.create_task(post(FLOOD))
                await _wait_running(client, 1)
                refused = await post(FLOOD)
                assert refused.status_code == 429, refused.text
                assert refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["type"] == "rate_limit_error"
                calm = await http.post(
                    url, json={**body, "max_tokens": 4}, headers={"Authorization": f"Bearer {CALM}"}
                )
                assert calm.status_code == 200, calm.text
                # A caller names a tenant by header; its key may not name this one: 403.
                named = await http.post(
                    url,
                    json={**body, "max_tokens": 4},
                    headers={"Authorization": f"Bearer {CALM}", "X-Stepwise-Tenant": "flood"},
                )
                assert named.status_code == 403, named.text
                first.cancel()
    finally:
        stop_processes([gateway])


def test_a_bad_tenant_file_fails_the_start_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "tenants.toml"
    bad.write_text("[tenants.a]\nweight = 1\ncolour = 'red'\n")
    flags = ["--port", "0", "--worker-port", "0", "--tenants", str(bad)]
    proc = subprocess.run(
        [sys.executable, "-m", "stepwise.cli", "control", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "tenants.a.colour: unknown field" in lines[0], proc.stderr
