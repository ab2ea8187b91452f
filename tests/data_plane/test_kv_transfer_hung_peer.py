"""A KV transfer to or from a peer that hangs (SIGSTOPped, a debugger, a link that drops every
packet) ends within its deadline, at both ends (docs/migration.md#deadlines-and-hung-peers).

The hung peer is a TCP relay between two transports in this process that stops moving bytes either
way when frozen: what a stopped process looks like from the network (its kernel still holds the
connection open, nothing answers), HTTP/2 pings included.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from data_plane import kv_transfer
from data_plane.kv_transfer import TransferFailed, TransferHeader, TransferStore
from data_plane.kv_transfer_grpc import GrpcKvTransport
from protos.stepwise.v1 import kv_transfer_pb2_grpc as kv_grpc

pytestmark = pytest.mark.timeout(60)

# Longer than any deadline below: an unbounded send is seen as one that is still running then.
HANG_S = 25.0
# The default deadline's floor (--transfer-deadline-floor), which a send of a few KiB gets.
DEFAULT_FLOOR_S = 15.0


class Relay:
    """Forwards TCP connections to `target_port` until `frozen` is set; from then on it moves no
    byte in either direction, and keeps every connection open."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{self.port}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        for w in (writer, up_writer):
            w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            if self.frozen.is_set():
                await asyncio.Event().wait()  # hung: holds the bytes and the connection
            writer.write(data)
            await writer.drain()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            self._server.close()


@contextlib.asynccontextmanager
async def relayed_pair(
    deadline: object = None, received: TransferStore | None = None
) -> AsyncIterator[tuple[GrpcKvTransport, GrpcKvTransport, Relay, str]]:
    """A receiver, a sender with `deadline` (None: the default), and a relay to the receiver:
    (sender, receiver, relay, the relay's address)."""
    receiver = GrpcKvTransport("127.0.0.1", 0, 64 << 20, received=received)
    options = {} if deadline is None else {"deadline": deadline}
    sender = GrpcKvTransport("127.0.0.1", 0, 64 << 20, **options)  # type: ignore[arg-type]
    relay = Relay(0)
    try:
        relay.target_port = int((await receiver.start()).rsplit(":", 1)[1])
        await sender.start()
        yield sender, receiver, relay, await relay.start()
    finally:
        await relay.stop()
        await sender.stop()
        await receiver.stop()


class _Unanswering(kv_grpc.KvTransferServiceServicer):
    """Takes every call and never answers it: a receiver alive (it answers pings) but stuck."""

    async def Send(self, request_iterator, context):  # type: ignore[no-untyped-def]
        await asyncio.Event().wait()


async def test_a_send_a_live_receiver_never_answers_fails_at_its_deadline() -> None:
    server = grpc.aio.server()
    kv_grpc.add_KvTransferServiceServicer_to_server(_Unanswering(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    sender = GrpcKvTransport("127.0.0.1", 0, 0, deadline=kv_transfer.TransferDeadline(1.0, 1e6))
    try:
        started = time.monotonic()
        with pytest.raises(TransferFailed) as err:
            await asyncio.wait_for(sender.send(f"127.0.0.1:{port}", "stuck", *_kv(1000)), HANG_S)
        took = time.monotonic() - started
    finally:
        await sender.stop()
        await server.stop(None)
    # 1 s, plus 64 KB at 1 MB/s.
    assert err.value.code == "DEADLINE_EXCEEDED"
    assert "deadline of 1.1 s" in err.value.details and "--transfer-deadline-floor" in err.value.details
    assert 1.0 <= took < 1.1 + 1.0


def _kv(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.zeros((2, tokens, 2, 8), dtype=torch.float16)
    return k, k.clone()


async def _timed_send(
    sender: GrpcKvTransport, address: str, transfer_id: str, tokens: int
) -> tuple[str, float]:
    """The send's failure code (or "OK") and how long it took; a send still running after HANG_S
    is the test's failure."""
    started = time.monotonic()
    try:
        await asyncio.wait_for(sender.send(address, transfer_id, *_kv(tokens)), HANG_S)
        code = "OK"
    except TransferFailed as exc:
        code = exc.code
    except TimeoutError:
        pytest.fail(f"the send to a hung peer was still running after {HANG_S:g} s")
    return code, time.monotonic() - started


def test_the_deadline_is_the_floor_plus_the_bytes_in_flight_at_the_assumed_rate() -> None:
    rule = kv_transfer.TransferDeadline(floor_s=2.0, bytes_per_s=1e6)
    assert rule.seconds(0) == 2.0
    assert rule.seconds(3_000_000) == pytest.approx(5.0)


async def test_a_send_to_a_peer_that_hung_after_connecting_fails_within_its_deadline() -> None:
    """The peer answered a first transfer (the channel is up), then hangs: today's send waited for
    its answer for good; now it fails at its deadline, as any failed send does (TransferFailed), so
    the control plane's fallback keeps the request on its source. (The default deadline: this
    test ran against the code before deadlines, and hung.)"""
    async with relayed_pair() as (sender, _, relay, address):
        assert (await _timed_send(sender, address, "warm", 4))[0] == "OK"
        relay.frozen.set()
        code, took = await _timed_send(sender, address, "hung", 64)
    assert code in ("DEADLINE_EXCEEDED", "UNAVAILABLE"), code
    assert took < DEFAULT_FLOOR_S + 2.0, (
        f"failed after {took:.2f} s, its deadline being {DEFAULT_FLOOR_S:g} s"
    )


async def test_a_hung_peer_is_found_by_keepalive_long_before_a_long_deadline() -> None:
    """A big transfer's deadline can be minutes; the channel's keepalive pings find a peer that
    stopped answering within seconds all the same."""
    async with relayed_pair(kv_transfer.TransferDeadline(floor_s=600.0, bytes_per_s=1e9)) as (
        sender,
        _,
        relay,
        address,
    ):
        await _timed_send(sender, address, "warm", 4)
        relay.frozen.set()
        code, took = await _timed_send(sender, address, "hung", 64)
    assert code == "UNAVAILABLE", code
    assert took < 10.0, f"found after {took:.2f} s"


class _FreezingStore(TransferStore):
    """Freezes the relay the moment it takes a header: the sender hangs with the receiver's room
    reserved for it (a sender stopped mid-transfer)."""

    relay: Relay | None = None

    def reserve(self, header: TransferHeader) -> None:
        super().reserve(header)
        if self.relay is not None:
            self.relay.frozen.set()


async def test_a_receiver_gives_back_the_room_of_a_sender_that_hung_mid_transfer() -> None:
    """The sender's deadline travels with its call: the receiver's end of it is cancelled when it
    passes (and its keepalive finds a sender that stopped answering), and the room is given back."""
    store = _FreezingStore(64 << 20)
    async with relayed_pair(received=store) as (sender, _, relay, address):
        store.relay = relay
        send = asyncio.create_task(_timed_send(sender, address, "stalled", 64))
        async with asyncio.timeout(HANG_S):
            while not relay.frozen.is_set():
                await asyncio.sleep(0.01)
        assert store.used_bytes > 0
        started = time.monotonic()
        while store.used_bytes and time.monotonic() - started < HANG_S:
            await asyncio.sleep(0.05)
        held_for = time.monotonic() - started
        await send
    assert store.used_bytes == 0, (
        f"{store.used_bytes} bytes still held {held_for:.1f} s after the sender hung"
    )
    assert held_for < DEFAULT_FLOOR_S + 2.0


async def test_a_new_connection_to_a_peer_that_never_answers_fails_within_seconds() -> None:
    """A stopped process's kernel still accepts a TCP connection, and no HTTP/2 handshake follows:
    gRPC's default connect timeout held such a send 20 s; it fails in 5 s, whatever its deadline."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the sender gives up and closes
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sender = GrpcKvTransport("127.0.0.1", 0, 0, deadline=kv_transfer.TransferDeadline(600.0, 1e9))
    try:
        code, took = await _timed_send(sender, f"127.0.0.1:{port}", "unanswered", 4)
    finally:
        await sender.stop()
        server.close()
    assert code == "UNAVAILABLE", code
    assert took < 10.0, f"failed after {took:.2f} s"
