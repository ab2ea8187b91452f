"""StepwiseClient's bearer token and TLS, against an in-test fake control plane, and its targets."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest

from clients.client import NotServingError, StepwiseClient, channel_target
from tests.certs import Issued, make_ca, make_cert
from tests.cli.fake_server import CANNED_TEXT, FakeState, serve_fake

pytestmark = pytest.mark.timeout(60)
METHODS = ("Check", "Generate", "Abort", "GetServerInfo")


@pytest.fixture
def server_cert(tmp_path: Path) -> Issued:
    return make_cert(make_ca(tmp_path / "ca"), tmp_path / "server", "control")


async def _every_call(client: StepwiseClient) -> None:
    await client.wait_ready(5)
    gen = await client.generate("hi", max_new_tokens=3)
    assert (gen.text, gen.finish_reason) == (CANNED_TEXT, "stop")
    assert await client.abort("nope") is False
    assert (await client.server_info()).model == "fake"


def _authorization(fake: FakeState) -> dict[str, set[str | None]]:
    return {m: {seen.get("authorization") for seen in fake.metadata[m]} for m in METHODS}


async def test_plaintext_without_a_key_sends_no_authorization() -> None:
    async with serve_fake() as fake, StepwiseClient(fake.address) as client:
        await _every_call(client)
    assert _authorization(fake) == {m: {None} for m in METHODS}


async def test_plaintext_with_a_key_sends_it_on_every_call() -> None:
    async with serve_fake(api_key="k1") as fake, StepwiseClient(fake.address, api_key="k1") as client:
        await _every_call(client)
    assert _authorization(fake) == {m: {"Bearer k1"} for m in METHODS}


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_tls_with_a_key(server_cert: Issued, host: str) -> None:
    async with serve_fake(tls=server_cert, api_key="k2") as fake:
        address = fake.address.replace("127.0.0.1", host)
        async with StepwiseClient(address, api_key="k2", tls_ca=server_cert.ca_cert) as client:
            await _every_call(client)
    assert _authorization(fake) == {m: {"Bearer k2"} for m in METHODS}


async def test_tls_without_a_key(server_cert: Issued) -> None:
    async with (
        serve_fake(tls=server_cert) as fake,
        StepwiseClient(fake.address, tls_ca=str(server_cert.ca_cert)) as client,
    ):
        await _every_call(client)
    assert _authorization(fake) == {m: {None} for m in METHODS}


async def test_tls_refuses_a_server_signed_by_another_ca(server_cert: Issued, tmp_path: Path) -> None:
    other = make_ca(tmp_path / "other", "other-ca")
    async with serve_fake(tls=server_cert) as fake, StepwiseClient(fake.address, tls_ca=other.cert) as client:
        with pytest.raises(NotServingError, match="UNAVAILABLE"):
            await client.wait_ready(3)
    assert not fake.metadata  # the handshake failed before any call reached the server


async def test_plaintext_client_cannot_talk_to_a_tls_server(server_cert: Issued) -> None:
    async with serve_fake(tls=server_cert) as fake, StepwiseClient(fake.address) as client:
        with pytest.raises(NotServingError):
            await client.wait_ready(1)


async def test_a_refused_health_check_is_raised_at_once() -> None:
    async with serve_fake(api_key="right") as fake, StepwiseClient(fake.address, api_key="wrong") as client:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.wait_ready(30)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert time.monotonic() - started < 10


async def test_not_serving_is_a_timeout_naming_the_address() -> None:
    async with StepwiseClient("127.0.0.1:1") as client:
        with pytest.raises(TimeoutError, match=r"no control plane serving at 127\.0\.0\.1:1 \(waited 0\.5 s"):
            await client.wait_ready(0.5)


def test_targets_that_name_several_control_planes_spread_calls():
    assert channel_target("127.0.0.1:50051") == ("127.0.0.1:50051", [])
    for address, target in [
        ("dns:///stepwise.default.svc:50051", "dns:///stepwise.default.svc:50051"),
        ("10.0.0.1:50051,10.0.0.2:50051", "ipv4:10.0.0.1:50051,10.0.0.2:50051"),
        ("[::1]:1,[::2]:2", "ipv6:[::1]:1,[::2]:2"),
    ]:
        got, options = channel_target(address)
        assert got == target
        config = json.loads(dict(options)["grpc.service_config"])
        assert config["loadBalancingConfig"] == [{"round_robin": {}}]
        assert config["methodConfig"][0]["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    with pytest.raises(ValueError, match="dns:///NAME:PORT"):
        channel_target("a.example:1,b.example:2")


async def test_generate_sends_the_constraint_flags(tmp_path: Path) -> None:
    """`stepwise generate --choice/--json-schema @FILE/--regex/--ebnf` reach the request's constraint."""
    from tests.cli.runner import run_cli_async

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    cases = [
        (["--choice", "red", "--choice", "green"], "choice"),
        (["--json-schema", f"@{tmp_path / 'schema.json'}"], "json_schema"),
        (["--regex", "[0-9]+"], "regex"),
        (["--ebnf", 'root ::= "a"'], "ebnf"),
    ]
    async with serve_fake() as fake:
        for flags, field_name in cases:
            code, _, err = await run_cli_async(["generate", "hi", "--address", fake.address, *flags])
            assert code == 0, err
            sampling = fake.requests[-1].sampling
            assert sampling.WhichOneof("constraint") == field_name
        assert list(fake.requests[0].sampling.choice.choices) == ["red", "green"]
        assert json.loads(fake.requests[1].sampling.json_schema) == schema
        code, _, err = await run_cli_async(
            ["generate", "hi", "--address", fake.address, "--regex", "a", "--choice", "b"]
        )
        assert code == 2 and "not allowed with argument" in err


def test_sampling_params_refuses_two_constraints() -> None:
    from clients.client import sampling_params

    with pytest.raises(ValueError, match="at most one constraint"):
        sampling_params(regex="a", choice=["b"])
    assert sampling_params(json_schema={"type": "object"}).json_schema == '{"type": "object"}'
