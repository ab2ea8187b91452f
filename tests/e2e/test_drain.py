"""Drains, moves and rebalancing against real control-plane processes, with sim workers in the test
process (tests/e2e/link_worker.py) so that each test decides when a worker drains and where it
goes after a Move.

- a worker that drains finishes its streams, then gets Shutdown; new requests go elsewhere;
- two control planes whose --peers name each other: the one with 3 workers moves its newest to the
  empty one, and stops once the spread is even;
- SIGTERM to a control plane under load: NOT_SERVING at once, new calls UNAVAILABLE with a retry
  message, running streams complete, one past --drain-timeout ends with an abort that says so,
  workers get Move, exit 0.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import Generation, StepwiseClient, apply_response, generate_request, sampling_params
from tests.e2e.conftest import ControlProcess
from tests.e2e.link_worker import LinkWorker, census
from tests.polling import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROMPT = [11, 12, 13, 14, 15]
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[object]:
    """`plane = await fleet.control(*flags)`, `worker = await fleet.worker(address, id)`: all stopped
    at teardown (workers first), also when the test fails."""
    planes: list[ControlProcess] = []
    workers: list[LinkWorker] = []

    class Fleet:
        async def control(self, *flags: str) -> ControlProcess:
            plane = ControlProcess(flags, tmp_path / f"plane-{len(planes)}")
            plane.tmp.mkdir()
            planes.append(plane)
            return await plane.start()

        async def worker(self, address: str, worker_id: str, step_s: float = 0.01) -> LinkWorker:
            worker = LinkWorker(address, worker_id, step_s)
            workers.append(worker)
            await worker.attach()
            assert worker.welcome is not None and worker.welcome.accepted, worker.welcome
            return worker

    try:
        yield Fleet()
    finally:
        for worker in workers:
            await worker.close()
        for plane in planes:
            plane.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _stream(client: StepwiseClient, max_new: int, progress: dict[str, int], name: str) -> Generation:
    gen = Generation()
    request = generate_request(PROMPT, sampling_params(max_new_tokens=max_new, ignore_eos=True), name)
    async for response in client.stream(request):
        apply_response(gen, response)
        progress[name] = len(gen.token_ids)
    return gen


async def _health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
        return int(reply.status)


async def test_a_draining_worker_finishes_its_streams_then_gets_shutdown(fleet) -> None:
    plane = await fleet.control("--max-running-requests", "2", "--drain-timeout", "60")
    w0 = await fleet.worker(plane.worker_address, "w0")
    await plane.wait_workers(1)
    progress: dict[str, int] = {}
    async with StepwiseClient(plane.address) as client:
        # Two run on w0 and two wait there (--max-running-requests 2) before w1 exists.
        tasks = [asyncio.create_task(_stream(client, 120, progress, f"r{i}")) for i in range(4)]

        async def two_running() -> bool:
            return sum(1 for n in progress.values() if n) >= 2

        await until(two_running, 20.0, "two streams running", every_s=0.02)
        w1 = await fleet.worker(plane.worker_address, "w1")
        await plane.wait_workers(2)
        await w0.drain("SIGTERM")

        async def w0_leaving() -> bool:
            workers = {w.worker_id: w for w in (await client.server_info()).workers}
            return workers["w0"].leaving and not workers["w1"].leaving

        await until(w0_leaving, 20.0, "w0 leaving", every_s=0.02)
        assert not w0.ended.is_set()  # its running streams are not done yet
        late = await client.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
        gens = await asyncio.gather(*tasks)
        assert await w0.wait_ended() == "shutdown", w0.error
        assert w0.ending is not None and w0.ending.shutdown.reason == "drained"
        info = await client.server_info()
    assert [(g.finish_reason, g.completion_tokens) for g in gens] == [("length", 120)] * 4
    assert (late.finish_reason, late.completion_tokens) == ("length", 20)
    assert [w.worker_id for w in info.workers] == ["w1"] and w1.steps > 0
    assert not w1.ended.is_set()


async def test_peers_rebalance_the_newest_worker_until_the_spread_is_even(fleet) -> None:
    port_a, port_b = _free_port(), _free_port()
    peers = f"127.0.0.1:{port_a},127.0.0.1:{port_b}"
    common = ("--peers", peers, "--rebalance-interval", "0.3")
    a = await fleet.control("--worker-port", str(port_a), *common)
    # b is not up yet: a's peers are unreachable (skipped), so it moves nothing while workers attach.
    workers = [await fleet.worker(a.worker_address, f"w{i}") for i in range(3)]
    await a.wait_workers(3)
    b = await fleet.control("--worker-port", str(port_b), *common)
    moved = await asyncio.wait_for(workers[2].ended.wait(), 30)
    assert moved and workers[2].ended_with == "move", workers[2].error
    assert "rebalancing" in workers[2].ending.move.reason  # type: ignore[union-attr]
    # What a real worker does after Move: attach to another control plane.
    await fleet.worker(b.worker_address, "w2")
    await b.wait_workers(1)
    await asyncio.sleep(2.0)  # about six more rounds: 2 against 1 is even, nothing moves
    assert not workers[0].ended.is_set() and not workers[1].ended.is_set()
    here, there = await census(a.worker_address), await census(b.worker_address)
    assert (here.workers, there.workers, here.accepting, there.accepting) == (2, 1, True, True)
    assert here.control_plane_id != there.control_plane_id


async def test_sigterm_drains_the_control_plane_under_load(fleet) -> None:
    drain_timeout = 4.0
    plane = await fleet.control("--drain-timeout", str(drain_timeout))
    workers = [await fleet.worker(plane.worker_address, f"w{i}") for i in range(2)]
    await plane.wait_workers(2)
    progress: dict[str, int] = {}
    async with StepwiseClient(plane.address) as client:
        short = [asyncio.create_task(_stream(client, 40, progress, f"short{i}")) for i in range(3)]
        long = asyncio.create_task(_stream(client, 100_000, progress, "long"))

        async def all_streaming() -> bool:
            return len(progress) == 4 and all(progress.values())

        await until(all_streaming, 20.0, "every stream's first token", every_s=0.02)
        signalled = time.monotonic()
        plane.control.send_signal(signal.SIGTERM)

        async def not_serving() -> bool:
            return await _health(plane.address) == NOT_SERVING

        await until(not_serving, 2.0, "NOT_SERVING", every_s=0.02)
        assert await _health(plane.address, "stepwise.v1.Generation") == NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate(PROMPT, max_new_tokens=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in (refused.value.details() or "") and "retry" in (refused.value.details() or "")
        # The worker port: still alive, not taking workers.
        assert await _health(plane.worker_address, "liveness") == SERVING
        assert await _health(plane.worker_address) == NOT_SERVING
        assert not (await census(plane.worker_address)).accepting
        gens = await asyncio.gather(*short)
        cut = await long
    assert [(g.finish_reason, g.completion_tokens) for g in gens] == [("length", 40)] * 3
    assert cut.finish_reason == "abort" and cut.finish_message.startswith("control plane drained")
    assert 0 < cut.completion_tokens < 100_000
    for worker in workers:
        assert await worker.wait_ended(drain_timeout + 10) == "move", worker.error
    code = await asyncio.to_thread(plane.control.wait, drain_timeout + 10)
    assert code == 0
    assert time.monotonic() - signalled < drain_timeout + 8


async def test_a_draining_control_plane_refuses_new_workers_as_retryable(fleet) -> None:
    plane = await fleet.control("--drain-timeout", "30")
    worker = await fleet.worker(plane.worker_address, "w0")
    async with StepwiseClient(plane.address) as client:
        task = asyncio.create_task(client.generate(PROMPT, max_new_tokens=300, ignore_eos=True))
        await until(lambda: _running(client), 20.0, "a running request", every_s=0.02)
        plane.control.send_signal(signal.SIGTERM)

        async def refusing() -> bool:
            return not (await census(plane.worker_address)).accepting

        await until(refusing, 5, "accepting=false", every_s=0.02)
        late = LinkWorker(plane.worker_address, "late")
        try:
            await late.attach()
            assert late.welcome is not None and not late.welcome.accepted
            assert late.welcome.retryable and "draining" in late.welcome.reason
        finally:
            await late.close()
        gen = await task
    assert (gen.finish_reason, gen.completion_tokens) == ("length", 300)
    assert await worker.wait_ended(20) == "move"
    assert await asyncio.to_thread(plane.control.wait, 20) == 0


async def _running(client: StepwiseClient) -> bool:
    return (await client.server_info()).running > 0


async def test_liveness_without_workers_and_a_twin_worker_refused_as_retryable(fleet) -> None:
    plane = await fleet.control()
    # No worker: not ready, but alive (liveness and startup probes must not depend on workers).
    assert await _health(plane.worker_address, "liveness") == SERVING
    assert await _health(plane.worker_address) == NOT_SERVING
    assert await _health(plane.address) == NOT_SERVING
    await fleet.worker(plane.worker_address, "twin")
    # A second session under an id whose session is live: refused, and it may try again later.
    second = LinkWorker(plane.worker_address, "twin")
    try:
        await second.attach()
        assert second.welcome is not None and not second.welcome.accepted
        assert second.welcome.retryable and "already attached" in second.welcome.reason
    finally:
        await second.close()
