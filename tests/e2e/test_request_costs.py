"""What a request costs before it is trusted (issue 37, item 5): with `--api-key` on, 16 bodies of
8 MiB sent with no key cost the gateway and the frontend nothing they keep. Both check the key
before they parse anything (they held ~1.6 GiB each afterwards: every body had been parsed), and the
frontend drops a stranger's bytes before it refuses the call (four bursts of 16 messages grew it
by ~258 MiB when the refusal's traceback held them).
Memory is read from /proc of the real processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest

from protos.stepwise.v1 import generation_pb2 as gen_pb
from stepwise.up import stop_processes
from tests.processes import ready_file_sync

pytestmark = pytest.mark.timeout(240)

KEY = "cost-test-key"
MIB = 1024 * 1024
CONCURRENT = 16
# Bursts of unauthenticated gRPC messages, one after another.
BURSTS = 4
GENERATE = "/stepwise.v1.Generation/Generate"


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _bodies() -> dict[str, bytes]:
    """Just under 8 MiB each (the gateway's default --max-body-bytes): 2M stop strings, a prompt of
    4.19M token ids, 256 prompts of 16k ids."""
    ids = ",".join(["1"] * 16_000)
    bodies = {
        "stop": b'{"prompt": "hi", "stop": [' + b",".join([b'"a"'] * 2_000_000) + b"]}",
        "ids": b'{"prompt": [' + b",".join([b"1"] * 4_190_000) + b"]}",
        "prompts": ('{"prompt": [' + ",".join([f"[{ids}]"] * 256) + "]}").encode(),
    }
    for body in bodies.values():
        assert len(body) <= 8 * MIB
    return bodies


@contextmanager
def _gateway(control: str, tmp: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    ready, log = tmp / "gateway.json", tmp / "gateway.log"
    args = ["gateway", "--control", control, "--port", "0", "--ready-file", str(ready)]
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stepwise.cli", *args], stdout=out, stderr=out)
    try:
        yield proc, f"http://127.0.0.1:{ready_file_sync(ready, proc, 60, 'the gateway', log=log)['port']}"
    finally:
        stop_processes([proc])


def _post_all(url: str, bodies: list[bytes]) -> list[int]:
    def post(body: bytes) -> int:
        with httpx.Client(timeout=120) as http:
            reply = http.post(
                f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}
            )
            return reply.status_code

    with ThreadPoolExecutor(CONCURRENT) as pool:
        return list(pool.map(post, bodies))


async def _generate_all(address: str, messages: list[bytes]) -> list[grpc.StatusCode]:
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 * MIB)]
    ) as channel:
        call = channel.unary_stream(GENERATE)

        async def one(message: bytes) -> grpc.StatusCode:
            try:
                async for _ in call(message, timeout=120):
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        return list(await asyncio.gather(*(one(m) for m in messages)))


def _messages() -> list[bytes]:
    stops = gen_pb.GenerateRequest(text="hi", sampling=gen_pb.SamplingParams(stop=["a"] * 2_000_000))
    ids = gen_pb.GenerateRequest(input_ids=gen_pb.TokenIds(ids=[1] * 1_000_000))
    return [stops.SerializeToString()] * (CONCURRENT // 2) + [ids.SerializeToString()] * (CONCURRENT // 2)


async def test_unauthenticated_bodies_cost_the_gateway_and_frontend_nothing_kept(
    start_control, tmp_path: Path
) -> None:
    plane = await start_control("--api-key", KEY, "--frontends", "1")
    (frontend,) = plane.ready["frontend_pids"]
    bodies = _bodies()
    with _gateway(plane.address, tmp_path) as (gateway, url):
        start = {"gateway": _rss_mib(gateway.pid), "frontend": _rss_mib(frontend)}
        for name, body in bodies.items():
            statuses = await asyncio.to_thread(_post_all, url, [body] * CONCURRENT)
            assert statuses == [401] * CONCURRENT, (name, statuses)
        # Four bursts: what a burst leaves must not add up (each kept ~55 MiB, burst after burst,
        # while a refusal's traceback held the message's bytes until a full garbage collection).
        for _ in range(BURSTS):
            codes = await _generate_all(plane.address, _messages())
            assert codes == [grpc.StatusCode.UNAUTHENTICATED] * CONCURRENT, codes
        await asyncio.sleep(0.5)
        grown = {
            "gateway": _rss_mib(gateway.pid) - start["gateway"],
            "frontend": _rss_mib(frontend) - start["frontend"],
        }
        peak = {"gateway": _rss_mib(gateway.pid, "VmHWM"), "frontend": _rss_mib(frontend, "VmHWM")}
        print(f"start {start} grown {grown} peak {peak}")
        assert grown["gateway"] < 100 and grown["frontend"] < 100, (start, grown, peak)
