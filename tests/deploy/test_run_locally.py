"""The cpu-sim overlay, run as local processes: its 2 control planes and 4 sim workers, started from the
rendered Deployments (args, ConfigMaps, Service names moved onto 127.0.0.1), serve 64 streams."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest

from clients.client import StepwiseClient
from stepwise.parent import PARENT_ENV
from stepwise.up import stop_processes
from tests.deploy.local import ProcessSpec, process_specs, remap
from tests.deploy.manifests import rendered

STREAMS_PER_CONTROL_PLANE = 32
MAX_NEW_TOKENS = 24
ATTACH_TIMEOUT_S = 120.0
# Workers drain and control planes drain on SIGTERM; with nothing running both are quick.
STOP_TIMEOUT_S = 45.0


def _start(spec: ProcessSpec, logs: Path) -> subprocess.Popen[bytes]:
    # The pod's environment only, plus what runs Python here; children die with this test.
    base = {k: v for k, v in os.environ.items() if not k.startswith("STEPWISE_")}
    log = (logs / f"{spec.pod}.log").open("wb")
    return subprocess.Popen(
        spec.argv,
        env={**base, **spec.env, PARENT_ENV: str(os.getpid())},
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=logs,
    )


def _client_address(spec: ProcessSpec) -> str:
    return f"127.0.0.1:{spec.ports[50051]}"


async def _attached(address: str) -> int | None:
    """Workers attached to the control plane at `address`, or None while it does not answer yet."""
    try:
        async with StepwiseClient(address) as client:
            return len((await asyncio.wait_for(client.server_info(), 2.0)).workers)
    except (grpc.aio.AioRpcError, TimeoutError):
        return None


async def _wait_attached(
    addresses: Sequence[str], workers: int, procs: Sequence[subprocess.Popen[bytes]]
) -> list[int]:
    """Wait until the control planes hold `workers` in all, each at least one (so each serves)."""
    deadline = time.monotonic() + ATTACH_TIMEOUT_S
    counts: list[int | None] = []
    while time.monotonic() < deadline:
        exited = [p.args for p in procs if p.poll() is not None]
        assert not exited, f"exited early: {exited}"
        counts = list(await asyncio.gather(*(_attached(a) for a in addresses)))
        if all(c is not None and c >= 1 for c in counts) and sum(c or 0 for c in counts) == workers:
            return [c or 0 for c in counts]
        await asyncio.sleep(0.5)
    raise AssertionError(f"workers attached per control plane: {counts}, want {workers} in all")


async def _serve(address: str, streams: int) -> list[tuple[str, int, int]]:
    async with StepwiseClient(address) as client:
        gens = await asyncio.gather(
            *(
                client.generate(f"Stream {i} of {address}:", max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
                for i in range(streams)
            )
        )
    return [(g.finish_reason, g.completion_tokens, len(g.token_ids)) for g in gens]


def _log_tails(logs: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(logs.glob("*.log"))
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_cpu_sim_overlay_serves_through_both_control_planes(tmp_path: Path) -> None:
    objects = rendered("overlays/cpu-sim")
    specs = remap(process_specs(objects), objects)
    controls = [s for s in specs if s.component == "control-plane"]
    workers = [s for s in specs if s.component == "worker"]
    assert (len(controls), len(workers)) == (2, 4)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs += [_start(spec, tmp_path) for spec in controls]
        procs += [_start(spec, tmp_path) for spec in workers]
        addresses = [_client_address(spec) for spec in controls]
        await _wait_attached(addresses, len(workers), procs)
        results = await asyncio.gather(*(_serve(a, STREAMS_PER_CONTROL_PLANE) for a in addresses))
        for address, finished in zip(addresses, results, strict=True):
            assert len(finished) == STREAMS_PER_CONTROL_PLANE
            assert set(finished) == {("length", MAX_NEW_TOKENS, MAX_NEW_TOKENS)}, (address, finished)
    except BaseException:
        print(_log_tails(tmp_path))
        raise
    finally:
        stop_processes(procs, STOP_TIMEOUT_S)
    # Every process stopped on SIGTERM (drained), none had to be killed.
    assert [p.returncode for p in procs] == [0] * len(procs), _log_tails(tmp_path)
