"""Security against real processes: mutual TLS between the planes, API keys and TLS for clients,
request ownership, ports that cannot be shared, and what GetServerInfo tells strangers."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from clients.client import StepwiseClient, generate_request, sampling_params
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc
from tests.certs import make_ca, make_cert
from tests.e2e.rogue import RogueWorker, hello

pytestmark = pytest.mark.timeout(120)

KEY = "s3cret-key-for-tests"


@pytest.fixture
def pki(tmp_path: Path):  # type: ignore[no-untyped-def]
    ca = make_ca(tmp_path / "pki")
    return {
        "ca": ca,
        "server": make_cert(ca, tmp_path / "pki", "control"),
        "worker": make_cert(ca, tmp_path / "pki", "worker-a", client=True),
        "stranger": make_cert(
            make_ca(tmp_path / "other", "other-ca"), tmp_path / "other", "rogue", client=True
        ),
    }


async def _secured(start_control, pki):  # type: ignore[no-untyped-def]
    return await start_control(
        "--tls-cert",
        str(pki["server"].cert),
        "--tls-key",
        str(pki["server"].key),
        "--worker-ca",
        str(pki["ca"].cert),
        "--api-key",
        KEY,
    )


def _tls_worker_flags(pki, cert) -> list[str]:  # type: ignore[no-untyped-def]
    return ["--tls-ca", str(pki["ca"].cert), "--tls-cert", str(cert.cert), "--tls-key", str(cert.key)]


async def _attach_refused(address: str, credentials: grpc.ChannelCredentials | None) -> None:
    with pytest.raises((grpc.aio.AioRpcError, TimeoutError)):
        async with RogueWorker(address, hello("intruder"), credentials=credentials) as rogue:
            assert rogue.welcome is None, "an intruder was welcomed"


async def test_only_workers_with_a_certificate_from_the_worker_ca_can_attach(start_control, pki) -> None:
    plane = await _secured(start_control, pki)
    plane.add_worker("w0", *_tls_worker_flags(pki, pki["worker"]))
    await plane.wait_workers(1, api_key=KEY, tls_ca=str(pki["ca"].cert))
    root = pki["ca"].cert.read_bytes()
    await _attach_refused(plane.worker_address, None)  # plaintext
    await _attach_refused(plane.worker_address, grpc.ssl_channel_credentials(root))  # no certificate
    stranger = pki["stranger"]
    await _attach_refused(
        plane.worker_address,
        grpc.ssl_channel_credentials(root, stranger.key.read_bytes(), stranger.cert.read_bytes()),
    )
    # A real worker with a stranger's certificate is refused too, and says so by exiting.
    intruder = plane.add_worker("w1", *_tls_worker_flags(pki, stranger), "--connect-timeout", "3")
    assert intruder.wait(30) != 0
    async with StepwiseClient(plane.address, api_key=KEY, tls_ca=pki["ca"].cert) as client:
        info = await client.server_info()
        gen = await client.generate([5, 6, 7], max_new_tokens=5, ignore_eos=True)
    assert [w.worker_id for w in info.workers] == ["w0"]
    assert (gen.finish_reason, gen.completion_tokens) == ("length", 5)


async def test_clients_need_the_key_and_tls(start_control, pki) -> None:
    plane = await _secured(start_control, pki)
    plane.add_worker("w0", *_tls_worker_flags(pki, pki["worker"]))
    ca = pki["ca"].cert
    await plane.wait_workers(1, api_key=KEY, tls_ca=str(ca))
    for key in (None, "wrong-key"):
        async with StepwiseClient(plane.address, api_key=key, tls_ca=ca) as client:
            for call in (
                client.generate([5, 6], max_new_tokens=2),
                client.abort("anything"),
                client.server_info(),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with StepwiseClient(plane.address, api_key=KEY) as plaintext:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await plaintext.stub.GetServerInfo(gen_pb.GetServerInfoRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    async with StepwiseClient(plane.address, api_key=KEY, tls_ca=ca) as client:
        info = await client.server_info()
    # A caller with a key may see where the model lives and which weights it is.
    assert info.model_path.startswith("/") and info.model_fingerprint
    assert info.model == "embedded"  # the served name, as the gateway reports it


async def test_a_client_can_abort_only_its_own_requests(start_control) -> None:
    """Without API keys a caller is its connection: another connection cannot abort the request."""
    plane = await start_control()
    plane.add_worker("w0", "--sim-cost", "0.02,0,0")
    await plane.wait_workers(1)
    # Channels of one process share connections unless told not to: a separate one is another client.
    separate = [("grpc.use_local_subchannel_pool", 1)]
    async with (
        StepwiseClient(plane.address) as owner,
        grpc.aio.insecure_channel(plane.address, options=separate) as other,
    ):
        task = asyncio.create_task(
            owner.generate([5, 6, 7], request_id="mine", max_new_tokens=400, ignore_eos=True)
        )
        while (await owner.server_info()).running < 1:
            await asyncio.sleep(0.01)
        stranger = gen_grpc.GenerationStub(other)
        assert not (await stranger.Abort(gen_pb.AbortRequest(request_id="mine"))).found
        assert await owner.abort("mine")
        gen = await asyncio.wait_for(task, 30)
    assert gen.finish_reason == "abort" and gen.completion_tokens < 400


async def test_with_api_keys_a_request_belongs_to_its_key(start_control, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-a\nkey-b\n")
    plane = await start_control("--api-key-file", str(keys))
    plane.add_worker("w0", "--sim-cost", "0.02,0,0")
    await plane.wait_workers(1, api_key="key-a")
    async with (
        StepwiseClient(plane.address, api_key="key-a") as a,
        StepwiseClient(plane.address, api_key="key-b") as b,
    ):
        task = asyncio.create_task(
            a.generate([5, 6, 7], request_id="a1", max_new_tokens=400, ignore_eos=True)
        )
        while (await a.server_info()).running < 1:
            await asyncio.sleep(0.01)
        assert not await b.abort("a1")
        assert await a.abort("a1")
        gen = await asyncio.wait_for(task, 30)
    assert gen.finish_reason == "abort"


async def test_a_live_request_id_is_refused_on_every_worker(start_control) -> None:
    plane = await start_control()
    plane.add_worker("w0", "--sim-cost", "0.02,0,0")
    plane.add_worker("w1", "--sim-cost", "0.02,0,0")
    await plane.wait_workers(2)
    async with StepwiseClient(plane.address) as client:
        first = asyncio.create_task(
            client.generate([5, 6], request_id="dup", max_new_tokens=200, ignore_eos=True)
        )
        while (await client.server_info()).running < 1:
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate([5, 6], request_id="dup", max_new_tokens=2)
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert await client.abort("dup")
        await first


async def test_server_info_tells_strangers_no_paths_fingerprints_or_worker_addresses(start_control) -> None:
    plane = await start_control()
    plane.add_worker("w0")  # serves KV transfers (the default), so it has an address to hide
    await plane.wait_workers(1)
    async with StepwiseClient(plane.address) as client:
        info = await client.server_info()
    assert info.model == "embedded" and info.model_path == ""
    assert info.model_fingerprint == ""
    assert [w.transfer_address for w in info.workers] == [""]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_second_control_plane_cannot_take_the_port(start_control) -> None:
    plane = await start_control()
    port = plane.address.rsplit(":", 1)[1]
    second = subprocess.run(
        [sys.executable, "-m", "stepwise.cli", "control", "--port", port, "--worker-port", str(_free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2, second.stderr
    assert port in second.stderr and "Traceback" not in second.stderr
    plane.add_worker("w0")
    await plane.wait_workers(1)


def test_the_worker_port_is_not_exposed_without_mutual_tls() -> None:
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepwise.cli",
            "control",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--worker-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "--worker-ca" in refused.stderr and "Traceback" not in refused.stderr


async def test_bad_utf8_and_non_finite_numbers_are_invalid_arguments(start_control) -> None:
    plane = await start_control()
    plane.add_worker("w0")
    await plane.wait_workers(1)
    good = gen_pb.GenerateRequest(text="héllo", sampling=gen_pb.SamplingParams(max_new_tokens=2))
    raw = bytearray(good.SerializeToString())
    raw[raw.index(0xC3)] = 0xFF
    async with grpc.aio.insecure_channel(plane.address) as channel:
        call = channel.unary_stream(
            "/stepwise.v1.Generation/Generate",
            request_serializer=lambda b: b,
            response_deserializer=gen_pb.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call(bytes(raw)):
                pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "text: not valid UTF-8"
    async with StepwiseClient(plane.address) as client:
        for name, value in (("temperature", float("inf")), ("presence_penalty", float("nan"))):
            request = generate_request([5, 6], sampling_params(max_new_tokens=2, **{name: value}))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in client.stream(request):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"sampling.{name}" in (refused.value.details() or "")


async def test_a_priority_refused_by_the_server_is_unavailable(start_control) -> None:
    """SGLang answers 503 when priority scheduling is off and --abort-on-priority-when-disabled is set:
    the server refuses, the input itself is fine (docs/scheduler.md#intake)."""
    plane = await start_control("--abort-on-priority-when-disabled")
    plane.add_worker("w0")
    await plane.wait_workers(1)
    async with StepwiseClient(plane.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate([5, 6, 7], max_new_tokens=2, priority=3)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "priority" in (refused.value.details() or "")


@pytest.mark.parametrize("size", [12_000, 60_000], ids=["12KB", "60KB"])
async def test_an_oversized_bearer_key_is_unauthenticated_naming_the_header(start_control, size: int) -> None:
    """gRPC's default metadata limits (8 KiB soft, 16 KiB hard) would answer RESOURCE_EXHAUSTED,
    which reads as "retry later"; a key that long is simply not a key."""
    plane = await start_control("--api-key", KEY)
    plane.add_worker("w0")
    await plane.wait_workers(1, api_key=KEY)
    for _ in range(3):  # between the soft and the hard limit gRPC refuses at random
        async with StepwiseClient(plane.address, api_key="k" * size) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.generate([5, 6, 7], max_new_tokens=2)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
        assert "authorization" in (refused.value.details() or "")
