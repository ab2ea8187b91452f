"""`--peers` and the other drain flags: the flags' validation (a ValueError naming the flag), and
asking peers over mutual TLS. The target syntax and its resolution: tests/test_targets.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest

from control_plane.config import Security, add_arguments, control_config_from_args
from control_plane.core.census import PeerCensus
from protos import worker_codec
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.stepwise.v1 import worker_pb2_grpc as wk_grpc
from protos.worker import WorkerLimits
from tests.certs import make_ca, make_cert


def _config(*flags: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return control_config_from_args(parser.parse_args(list(flags)), Path("."))


def test_drain_and_peer_flags() -> None:
    config = _config()
    assert (config.drain_timeout_s, config.peers, config.rebalance_interval_s) == (30.0, "", 2.0)
    config = _config("--drain-timeout", "0", "--peers", "dns:///cp:50052", "--rebalance-interval", "0.5")
    assert (config.drain_timeout_s, config.rebalance_interval_s) == (0.0, 0.5)
    assert config.peers == "dns:///cp:50052"


def test_a_malformed_peer_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--peers: 'nowhere' is not HOST:PORT"):
        _config("--peers", "nowhere")


@pytest.mark.parametrize("flag", ["--drain-timeout=-1", "--drain-timeout=nan", "--rebalance-interval=0"])
def test_out_of_range_values_are_refused_by_the_flags(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The flags' types hold the ranges (flagtypes; every flag: tests/cli/test_flag_table.py)."""
    with pytest.raises(SystemExit) as exited:
        _config(flag)
    assert exited.value.code == 2 and f"argument {flag.split('=')[0]}: expected" in capsys.readouterr().err


class _Answering(wk_grpc.WorkerLinkServicer):
    async def Census(self, request: wk_pb.CensusRequest, context: object) -> wk_pb.CensusReply:
        return wk_pb.CensusReply(control_plane_id="peer", workers=3, accepting=True)


@pytest.mark.timeout(30)
async def test_with_worker_mtls_peers_are_asked_with_this_control_planes_certificate(tmp_path: Path) -> None:
    """One CA signs every control plane's certificate; each presents its own to the others' worker
    ports (which require a client certificate) and checks theirs against --worker-ca."""
    ca, stranger = make_ca(tmp_path), make_ca(tmp_path, "stranger-ca")
    server_cert = make_cert(ca, tmp_path, "peer", server_and_client=True)
    server = grpc.aio.server()
    wk_grpc.add_WorkerLinkServicer_to_server(_Answering(), server)
    creds = grpc.ssl_server_credentials(
        [server_cert.key_and_chain()], root_certificates=ca.cert.read_bytes(), require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    try:
        mine = make_cert(ca, tmp_path, "me", server_and_client=True)
        trusted = Security(tls_cert=mine.cert, tls_key=mine.key, worker_ca=ca.cert)
        for target in (f"127.0.0.1:{port}", f"localhost:{port}"):  # by address, and by name
            peers = PeerCensus(target, trusted)
            try:
                assert [(c.control_plane_id, c.workers) for c in await peers.poll()] == [("peer", 3)]
            finally:
                await peers.close()
        # A certificate the peer's CA did not sign, or none at all: the peer is left out.
        foreign = make_cert(stranger, tmp_path, "foreign", server_and_client=True)
        for security in (
            Security(tls_cert=foreign.cert, tls_key=foreign.key, worker_ca=ca.cert),
            Security(),
        ):
            peers = PeerCensus(f"127.0.0.1:{port}", security)
            try:
                assert await peers.poll() == []
            finally:
                await peers.close()
    finally:
        await server.stop(None)


class _Judging(wk_grpc.WorkerLinkServicer):
    """A peer that refuses every worker with page size 1 and says so in its census."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def Census(self, request: wk_pb.CensusRequest, context: object) -> wk_pb.CensusReply:
        hello = worker_codec.census_hello(request)
        self.asked.append(hello.worker_id if hello is not None else "")
        refusal = "page_size 1 differs" if hello is not None and hello.page_size == 1 else ""
        return wk_pb.CensusReply(
            control_plane_id="peer", accepting=True, hello_judged=hello is not None, refusal=refusal
        )


@pytest.mark.timeout(30)
async def test_peers_are_asked_whether_they_would_take_the_worker_to_move() -> None:
    servicer, server = _Judging(), grpc.aio.server()
    wk_grpc.add_WorkerLinkServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    peers = PeerCensus(f"127.0.0.1:{port}", Security())
    try:
        worker = WorkerLimits("w-7", kv_capacity_tokens=64, page_size=1, max_context=64, vocab_size=64)
        [judged] = await peers.poll(worker)
        assert judged.refuses() and judged.refusal == "page_size 1 differs"
        [counted] = await peers.poll()
        assert not counted.hello_judged
        assert servicer.asked == ["w-7", ""]
    finally:
        await peers.close()
        await server.stop(None)
