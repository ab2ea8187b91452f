"""A fleet of real processes: several `stepwise control` whose --peers name each other, and sim
workers whose --control names them all. Scaling either plane, draining and killing converge to an
even spread with no stream lost.

Each test prints what it measured (convergence and re-homing times) as a `fleet:` line; run with
`-s` to see them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from clients.client import Generation, StepwiseClient, apply_response, generate_request, sampling_params
from stepwise.up import free_ports, stop_processes
from tests.polling import until
from tests.processes import DidNotStart, ready_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPT = [11, 12, 13, 14, 15]
# The sim worker's step costs 10 ms: a 300-token stream runs for about 3 s.
SIM = ["--backend", "sim", "--sim-cost", "0.01,0,0"]
# A SIGKILLed control plane's clients see UNAVAILABLE within this bound (the kernel closes the
# connection at once; nothing waits for a timeout).
KILLED_CLIENT_BOUND_S = 5.0
# Its workers attach elsewhere within this bound (redial backoff up to --reconnect-max-backoff 1 s).
REHOME_BOUND_S = 10.0


class Fleet:
    def __init__(self, tmp: Path, planes: int) -> None:
        self.tmp = tmp
        self.worker_ports = free_ports(planes)
        self.peers = ",".join(f"127.0.0.1:{port}" for port in self.worker_ports)
        self.controls: dict[int, subprocess.Popen[bytes]] = {}
        self.addresses: dict[int, str] = {}
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[object] = []

    def _spawn(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        out = log.open("wb")
        self.logs.append(out)
        return subprocess.Popen(
            [sys.executable, "-m", "stepwise.cli", *args], stderr=out, env=dict(os.environ)
        )

    async def control(self, i: int, *flags: str) -> str:
        ready = self.tmp / f"control-{i}.json"
        args = ["control", "--host", "127.0.0.1", "--port", "0", "--worker-port", str(self.worker_ports[i])]
        args += ["--peers", self.peers, "--rebalance-interval", "0.5", "--drain-timeout", "10"]
        args += ["--log-level", "info", *flags, "--ready-file", str(ready)]
        log = self.tmp / f"control-{i}.log"
        proc = self.controls[i] = self._spawn(args, log)
        self.addresses[i] = (
            f"127.0.0.1:{(await ready_file(ready, proc, 60, f'control plane {i}', log=log))['port']}"
        )
        return self.addresses[i]

    def worker(self, name: str, *flags: str) -> None:
        args = ["worker", "--model", "embedded", *SIM, "--control", self.peers, "--worker-id", name]
        args += ["--reconnect-max-backoff", "1", "--log-level", "info", *flags]
        self.workers[name] = self._spawn(args, self.tmp / f"{name}.log")

    async def spread(self) -> dict[int, int]:
        """Workers attached and not leaving, per running control plane."""
        counts = {}
        for i, address in self.addresses.items():
            if self.controls[i].poll() is not None:
                continue
            async with StepwiseClient(address) as client:
                info = await client.server_info()
            counts[i] = sum(1 for w in info.workers if not w.leaving)
        return counts

    async def wait_spread(self, good: Callable[[list[int]], bool], timeout: float, what: str) -> float:
        """Seconds until the sorted counts satisfy `good`."""
        started = time.monotonic()
        counts: list[int] = []
        while time.monotonic() - started < timeout:
            counts = sorted((await self.spread()).values())
            if good(counts):
                return time.monotonic() - started
            await asyncio.sleep(0.05)
        raise AssertionError(f"{what}: spread {counts} after {timeout} s")

    def log_events(self, i: int, event: str) -> list[dict[str, object]]:
        lines = (self.tmp / f"control-{i}.log").read_text().splitlines()
        return [e for e in map(_json, lines) if e is not None and e.get("event") == event]

    def stop(self) -> None:
        stop_processes([*self.controls.values(), *self.workers.values()], timeout=15)
        for out in self.logs:
            out.close()  # type: ignore[attr-defined]


def _json(line: str) -> dict[str, object] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Callable[[int], Fleet]]:
    made: list[Fleet] = []

    def make(planes: int) -> Fleet:
        made.append(Fleet(tmp_path, planes))
        return made[-1]

    try:
        yield make
    finally:
        for one in made:
            one.stop()


def even(counts: list[int]) -> bool:
    return bool(counts) and counts[-1] - counts[0] <= 1


async def _stream(address: str, max_new: int, progress: dict[str, int], name: str) -> Generation:
    gen = Generation()
    request = generate_request(PROMPT, sampling_params(max_new_tokens=max_new, ignore_eos=True), name)
    async with StepwiseClient(address) as client:
        async for response in client.stream(request):
            apply_response(gen, response)
            progress[name] = len(gen.token_ids)
    return gen


def _load(addresses: list[str], per_plane: int, max_new: int, progress: dict[str, int]) -> list[asyncio.Task]:  # type: ignore[type-arg]
    return [
        asyncio.create_task(_stream(address, max_new, progress, f"p{i}-{j}"))
        for i, address in enumerate(addresses)
        for j in range(per_plane)
    ]


async def _planes(fleet: Callable[[int], Fleet], planes: int, *flags: tuple[str, ...]) -> Fleet:
    """A fleet of `planes` peers whose first len(flags) control planes run (with those flags). Its
    worker ports are picked free beforehand, and all of them go into every plane's --peers, so a
    plane whose port was taken meanwhile (free_ports holds none: any client's ephemeral port may
    land on it, as CI once saw) cannot just move: the fleet starts again on fresh ports."""
    for attempt in range(3):
        f = fleet(planes)
        try:
            for i, own in enumerate(flags):
                await f.control(i, *own)
            return f
        except DidNotStart as exc:
            taken = any(f"127.0.0.1:{port}" in str(exc) for port in f.worker_ports)
            if attempt == 2 or not taken:
                raise
            f.stop()
    raise AssertionError("unreachable")


async def _two_planes_four_workers(fleet: Callable[[int], Fleet], planes: int = 2) -> Fleet:
    f = await _planes(fleet, planes, (), ())
    for k in range(4):
        f.worker(f"w{k}")
    await f.wait_spread(lambda c: c == [2, 2], 30, "four workers over two control planes")
    return f


async def test_a_third_control_plane_gets_its_share_within_10_s_and_no_stream_is_lost(fleet) -> None:
    f = await _two_planes_four_workers(fleet, planes=3)
    progress: dict[str, int] = {}
    tasks = _load([f.addresses[0], f.addresses[1]], 16, 300, progress)
    await until(lambda: len(progress) == 32, 20, "every stream started", every_s=0.02)
    started = time.monotonic()
    await f.control(2)
    converged = await f.wait_spread(lambda c: len(c) == 3 and even(c), 10, "scale-out")
    gens = await asyncio.gather(*tasks)
    assert [(g.finish_reason, g.completion_tokens) for g in gens] == [("length", 300)] * 32
    print(
        f"fleet: scale-out 2->3 control planes, 4 workers: even in {time.monotonic() - started:.2f} s "
        f"(spread polled {converged:.2f} s after the third was up)"
    )


async def test_sigterm_on_a_control_plane_under_load_finishes_its_streams_and_rehomes_its_workers(
    fleet,
) -> None:
    f = await _two_planes_four_workers(fleet)
    progress: dict[str, int] = {}
    tasks = _load([f.addresses[0], f.addresses[1]], 16, 200, progress)
    await until(
        lambda: len(progress) == 32 and min(progress.values()) > 5, 20, "every stream running", every_s=0.02
    )
    started = time.monotonic()
    f.controls[1].send_signal(signal.SIGTERM)
    gens = await asyncio.gather(*tasks)
    assert [(g.finish_reason, g.completion_tokens) for g in gens] == [("length", 200)] * 32
    assert f.controls[1].wait(20) == 0
    exited = time.monotonic() - started
    rehomed = await f.wait_spread(lambda c: c == [4], REHOME_BOUND_S, "workers re-homed")
    # New calls over both addresses: the gone one is skipped (round robin, UNAVAILABLE retried).
    both = f"{f.addresses[0]},{f.addresses[1]}"
    async with StepwiseClient(both) as client:
        fresh = await asyncio.gather(*(client.generate(PROMPT, max_new_tokens=8) for _ in range(16)))
    assert all(g.finish_reason in ("stop", "length") and g.token_ids for g in fresh)
    print(
        f"fleet: SIGTERM under load: drained and exited in {exited:.2f} s, workers re-homed "
        f"{rehomed:.2f} s later"
    )


async def test_a_sigkilled_control_plane_fails_its_clients_fast_and_its_workers_rehome(fleet) -> None:
    f = await _two_planes_four_workers(fleet)
    progress: dict[str, int] = {}
    tasks = _load([f.addresses[1]], 8, 2000, progress)
    await until(
        lambda: len(progress) == 8 and min(progress.values()) > 5, 20, "streams running", every_s=0.02
    )
    started = time.monotonic()
    f.controls[1].send_signal(signal.SIGKILL)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failed = time.monotonic() - started
    assert all(isinstance(r, grpc.aio.AioRpcError) for r in results), results
    assert {r.code() for r in results} == {grpc.StatusCode.UNAVAILABLE}  # type: ignore[union-attr]
    assert failed < KILLED_CLIENT_BOUND_S
    rehomed = await f.wait_spread(lambda c: c == [4], REHOME_BOUND_S, "workers re-homed")
    async with StepwiseClient(f.addresses[0]) as client:
        fresh = await asyncio.gather(*(client.generate(PROMPT, max_new_tokens=8) for _ in range(8)))
    assert all(g.finish_reason in ("stop", "length") and g.token_ids for g in fresh)
    print(
        f"fleet: SIGKILL: clients got UNAVAILABLE within {failed:.2f} s, workers re-homed "
        f"{rehomed:.2f} s after that"
    )


async def test_a_worker_drained_under_load_finishes_its_streams_without_recomputing_them(fleet) -> None:
    f = await _planes(fleet, 1, ("--max-running-requests", "4"))
    f.worker("w0")
    await f.wait_spread(lambda c: c == [1], 30, "w0 attached")
    f.worker("w1")
    await f.wait_spread(lambda c: c == [2], 30, "w1 attached")
    progress: dict[str, int] = {}
    tasks = _load([f.addresses[0]], 16, 150, progress)
    await until(
        lambda: sum(1 for n in progress.values() if n > 5) >= 8, 20, "both workers busy", every_s=0.02
    )
    f.workers["w0"].send_signal(signal.SIGTERM)
    gens = await asyncio.gather(*tasks)
    assert [(g.finish_reason, g.completion_tokens) for g in gens] == [("length", 150)] * 16
    assert f.workers["w0"].wait(20) == 0
    drained = [e for e in f.log_events(0, "worker drained") if e.get("worker") == "w0"]
    draining = [e for e in f.log_events(0, "worker draining") if e.get("worker") == "w0"]
    assert len(drained) == len(draining) == 1, (drained, draining)
    # Its running requests finished on it or migrated with their KV (the sim's workers move KV
    # too): none handed over, so none prefilled again elsewhere; only requests that had not started
    # moved otherwise.
    start, end = draining[0], drained[0]
    assert start["running"] > 0 and end["handed_over"] == 0
    settled = end["finished"] + end["migrated"]  # type: ignore[operator]
    assert settled == start["running"] + start["queued"] - start["moved"]  # type: ignore[operator]


async def test_a_control_plane_that_refuses_every_worker_neither_ends_them_nor_gets_them_moved(
    fleet,
) -> None:
    """B refuses every worker for good (its --page-size 16, the workers' 1) and so always looks
    emptiest. Every worker still ends up on A and stays there, and A never hands one to B: once,
    every worker exited 2 within 8 s and A moved its workers to B one by one."""
    f = await _planes(fleet, 2, (), ("--page-size", "16"))
    for k in range(4):
        f.worker(f"w{k}")
    await f.wait_spread(lambda c: c == [0, 4], 30, "every worker on the control plane that takes it")
    watched_s = 5.0  # 10 rebalance intervals
    deadline = time.monotonic() + watched_s
    while time.monotonic() < deadline:
        exited = {name: p.returncode for name, p in f.workers.items() if p.poll() is not None}
        assert not exited, f"workers exited: {exited}"
        await asyncio.sleep(0.1)
    assert await f.spread() == {0: 4, 1: 0}
    assert f.log_events(0, "rebalance: moving a worker") == []
    print(f"fleet: a control plane refusing every worker: 4 workers stayed on the other for {watched_s:g} s")
