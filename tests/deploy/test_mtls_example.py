"""examples/mtls, run locally: a control plane and a worker from the rendered Deployments with their
Secrets as files here attach over mutual TLS, and the example's readiness check (the kubelet's gRPC
probe cannot speak TLS) says not ready before a worker attaches and ready after."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepwise.parent import PARENT_ENV
from stepwise.up import stop_processes
from tests.certs import make_ca, make_cert
from tests.deploy.local import ProcessSpec, process_specs, remap
from tests.deploy.manifests import CONTROL, container, rendered

READY_TIMEOUT_S = 60.0


def _secrets(tmp: Path) -> dict[str, dict[str, str]]:
    """Component -> the files its Secret volume holds at /tls, as paths here."""
    ca = make_ca(tmp)
    control = make_cert(ca, tmp, "stepwise", dns=("stepwise", "stepwise-headless", "stepwise-workers"))
    worker = make_cert(ca, tmp, "stepwise-worker-0", client=True)
    files = {
        "control-plane": {"/tls/tls.crt": control.cert, "/tls/tls.key": control.key},
        "worker": {"/tls/tls.crt": worker.cert, "/tls/tls.key": worker.key},
    }
    return {c: {"/tls/ca.crt": str(ca.cert), **{k: str(v) for k, v in f.items()}} for c, f in files.items()}


def _start(spec: ProcessSpec, files: dict[str, str], logs: Path) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("STEPWISE_")}
    env = {k: files.get(v, v) for k, v in spec.env.items()}
    log = (logs / f"{spec.pod}.log").open("wb")
    return subprocess.Popen(
        spec.argv, env={**base, **env, PARENT_ENV: str(os.getpid())}, stdout=log, stderr=subprocess.STDOUT
    )


def _readiness(script: str, control: ProcessSpec, files: dict[str, str]) -> tuple[int, str]:
    """Run the example's readiness check against the local control plane: (exit status, stderr)."""
    local = script.replace("127.0.0.1:50051", f"127.0.0.1:{control.ports[50051]}")
    for path, here in files.items():
        local = local.replace(path, here)
    done = subprocess.run([sys.executable, "-c", local], capture_output=True, text=True, timeout=30)
    return done.returncode, done.stderr


async def _first_answer(script: str, control: ProcessSpec, files: dict[str, str]) -> tuple[int, str]:
    """The readiness check's first verdict that is not a failure to connect (the port is not up, or
    a connection reached the guard that holds it until the frontends listen, and was reset)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        status, stderr = _readiness(script, control, files)
        if "StatusCode.UNAVAILABLE" not in stderr or time.monotonic() > deadline:
            return status, stderr[-600:]
        await asyncio.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_mtls_example_attaches_a_worker_and_its_readiness_check_follows(tmp_path: Path) -> None:
    objects = rendered("examples/mtls")
    command = container(objects, CONTROL)["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    specs = {s.pod: s for s in remap(process_specs(objects), objects)}
    control, worker = specs["stepwise-control-0"], specs["stepwise-worker-0"]
    secrets = _secrets(tmp_path)
    procs = [_start(control, secrets["control-plane"], tmp_path)]
    try:
        # The check completes over TLS and answers "not ready": no worker is attached yet.
        assert await _first_answer(command[2], control, secrets["control-plane"]) == (1, "")
        assert procs[0].poll() is None
        procs.append(_start(worker, secrets["worker"], tmp_path))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while _readiness(command[2], control, secrets["control-plane"])[0] != 0:
            assert all(p.poll() is None for p in procs), "a process exited"
            assert time.monotonic() < deadline, "the worker did not attach over mutual TLS"
            await asyncio.sleep(0.5)
    except BaseException:
        print("\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(tmp_path.glob("*.log"))))
        raise
    finally:
        stop_processes(procs, 45.0)
