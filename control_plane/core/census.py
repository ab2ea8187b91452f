"""The census: how many workers a control plane holds and how busy they are (WorkerLink.Census),
and, asked about a hello, whether it would refuse that worker for good (server.py judges it as
Connect would).

A worker asks every control plane it can find before it attaches (it takes the one with the fewest
workers that would take it); control planes ask their peers, about the worker they would move, to
decide whether to hand it over (rebalance.py). `take` (fleet/census.py) counts this control plane;
`PeerCensus` asks the peers. Workers that are leaving (draining or moving away) are not counted:
they are about to be gone.

With mutual TLS on the worker port (`--worker-ca`), a control plane asks its peers as a worker
would: it presents its own `--tls-cert`/`--tls-key` and checks theirs against `--worker-ca`, so one
CA must sign the workers' and every control plane's certificates, and a control plane's certificate
must allow client authentication too (extended key usage serverAuth and clientAuth).
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from control_plane.config import Security
from protos import worker_codec
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.stepwise.v1 import worker_pb2_grpc as wk_grpc
from protos.targets import Address, Endpoint, parse_targets, resolve
from protos.worker import Census, WorkerLimits

log = structlog.get_logger("stepwise.census")

# A peer that does not answer within this long is left out of this round.
PEER_TIMEOUT_S = 1.0


class PeerCensus:
    """Asks every address of `--peers` for its census, concurrently; a peer that cannot be reached
    or does not answer in time is left out. Channels are kept per address between rounds."""

    def __init__(self, target: str, security: Security, timeout_s: float = PEER_TIMEOUT_S) -> None:
        self.endpoints: tuple[Endpoint, ...] = parse_targets(target, "--peers")
        self.security = security
        self.timeout_s = timeout_s
        self._channels: dict[Address, grpc.aio.Channel] = {}

    async def poll(self, hello: WorkerLimits | None = None) -> list[Census]:
        """The census of every peer that answered (this control plane's own among them, if it is
        in the target); asked too whether each would take a worker with `hello`."""
        addresses = await resolve(self.endpoints)
        await self._forget_except(set(addresses))
        request = worker_codec.census_request(hello)
        replies = await asyncio.gather(*(self._ask(a, request) for a in addresses))
        return [reply for reply in replies if reply is not None]

    async def _ask(self, address: Address, request: wk_pb.CensusRequest) -> Census | None:
        stub = wk_grpc.WorkerLinkStub(self._channel(address))
        try:
            reply = await stub.Census(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("peer did not answer", peer=address.target, status=exc.code().name)
            return None
        return worker_codec.census_from_proto(reply)

    def _channel(self, address: Address) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._open(address)
            self._channels[address] = channel
        return channel

    def _open(self, address: Address) -> grpc.aio.Channel:
        security = self.security
        if security.worker_ca is None or security.tls_cert is None or security.tls_key is None:
            return grpc.aio.insecure_channel(address.target)
        creds = grpc.ssl_channel_credentials(
            root_certificates=security.worker_ca.read_bytes(),
            private_key=security.tls_key.read_bytes(),
            certificate_chain=security.tls_cert.read_bytes(),
        )
        # Dialled by address; the certificate names the host name the address was found under.
        name = address.tls_name
        options = [("grpc.ssl_target_name_override", name)] if name else []
        return grpc.aio.secure_channel(address.target, creds, options=options)

    async def _forget_except(self, keep: set[Address]) -> None:
        for address in [a for a in self._channels if a not in keep]:
            await self._channels.pop(address).close(grace=None)

    async def close(self) -> None:
        await self._forget_except(set())
