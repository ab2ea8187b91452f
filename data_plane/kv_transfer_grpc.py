"""The KV transport over gRPC (protos/stepwise/v1/kv_transfer.proto): one client-streaming Send call
per transfer, a header then chunks of raw bytes; the sender awaits each write, so gRPC's flow control
bounds the bytes in flight. With TLS files, both ends use mutual TLS: the server asks for a client
certificate signed by the CA, and the client presents the worker's own.

Nothing waits on a peer for good: each send has a deadline (`TransferDeadline`), which gRPC carries
to the receiver too (its end of the call is cancelled when it passes); both ends ping the other
while a call is open, and a connection must finish its handshake within seconds, so a peer that
stops answering (SIGSTOP, a hung host, a link that drops every packet) ends the call within seconds
even when its deadline is far off.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from data_plane.kv_transfer import (
    DEFAULT_HOLD_S,
    BadTransfer,
    KvTransport,
    TransferDeadline,
    TransferFailed,
    TransferHeader,
    TransferRefused,
    TransferStore,
    host_bytes,
    tensors_from,
)
from protos.stepwise.v1 import kv_transfer_pb2 as kv_pb
from protos.stepwise.v1 import kv_transfer_pb2_grpc as kv_grpc

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
# A chunk's framing and a header fit in this much beyond the chunk itself.
_MESSAGE_MARGIN = 64 * 1024
MESSAGE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_CHUNK_BYTES + _MESSAGE_MARGIN),
    ("grpc.max_send_message_length", MAX_CHUNK_BYTES + _MESSAGE_MARGIN),
]
# While a call is open each end pings the other this often, and gives up on the connection (every
# call on it fails UNAVAILABLE) when a ping is not answered within the timeout. gRPC's core answers
# pings on threads of its own: a receiver whose Python holds the GIL for seconds (a long step, a
# collection) still answers; a stopped process does not.
KEEPALIVE_TIME_MS = 2000
KEEPALIVE_TIMEOUT_MS = 3000
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # Newer gRPC times a ping's ack with this (60 s by default), not with keepalive_timeout_ms.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    # A sender stalled by flow control sends no data between pings: keep pinging regardless.
    ("grpc.http2.max_pings_without_data", 0),
]
# A connection whose peer does not finish the HTTP/2 handshake within this long fails (gRPC's
# default waits 20 s): a stopped process's kernel still accepts the TCP connection.
CONNECT_TIMEOUT_MS = 5000
CHANNEL_OPTIONS = [
    *MESSAGE_OPTIONS,
    *KEEPALIVE_OPTIONS,
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
]
# Without SO_REUSEPORT, a port another process holds is an error here, not a shared port. The
# server takes the senders' pings (by default it would close a connection pinged more often than
# every 5 minutes while it sends nothing, which a receiver does while data comes in).
SERVER_OPTIONS = [
    *MESSAGE_OPTIONS,
    *KEEPALIVE_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
# The receiver's initial metadata once it has taken a header: the sender may write the data.
ACCEPTED_KEY = "stepwise-kv-accepted"
ACCEPTED = ((ACCEPTED_KEY, "1"),)
# The store is swept this long after a copy's hold deadline (a timer may fire a moment early).
_EXPIRY_LAG_S = 0.05


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for mutual TLS: the CA both ends trust, and this worker's certificate and key."""

    ca: Path
    cert: Path
    key: Path


class GrpcKvTransport(KvTransport):
    """Serves KvTransferService on `host:port` (0: a free port) and sends to other workers' ones,
    each send within `deadline`."""

    def __init__(
        self,
        host: str,
        port: int,
        buffer_bytes: int,
        tls: TlsFiles | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        received: TransferStore | None = None,
        deadline: TransferDeadline = TransferDeadline(),  # noqa: B008 (frozen)
        hold_s: float = DEFAULT_HOLD_S,
    ) -> None:
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes {chunk_bytes}: must be in [1, {MAX_CHUNK_BYTES}]")
        self.received = received or TransferStore(buffer_bytes, hold_s)
        self._host, self._port = host, port
        self._chunk_bytes = chunk_bytes
        self._deadline = deadline
        # The bytes of the sends under way, which share this worker's link (see TransferDeadline).
        self._in_flight_bytes = 0
        self._server_creds: grpc.ServerCredentials | None = None
        self._channel_creds: grpc.ChannelCredentials | None = None
        if tls is not None:
            key, cert, ca = tls.key.read_bytes(), tls.cert.read_bytes(), tls.ca.read_bytes()
            self._server_creds = grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca, require_client_auth=True
            )
            self._channel_creds = grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
        self._server: grpc.aio.Server | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def start(self) -> str:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        kv_grpc.add_KvTransferServiceServicer_to_server(_Receiver(self.received), server)
        where = _address(self._host, self._port)
        try:
            creds = self._server_creds
            port = server.add_secure_port(where, creds) if creds else server.add_insecure_port(where)
        except RuntimeError:
            port = 0
        if not port:
            raise OSError(f"--transfer-port: cannot listen on {where} (is another server using it?)")
        await server.start()
        self._server = server
        return _address(advertised_host(self._host), port)

    async def send(self, dest_address: str, transfer_id: str, k: torch.Tensor, v: torch.Tensor) -> int:
        header = TransferHeader.of(transfer_id, k, v)
        self._in_flight_bytes += header.total_bytes
        try:
            return await self._send(dest_address, header, k, v)
        finally:
            self._in_flight_bytes -= header.total_bytes

    async def _send(self, dest_address: str, header: TransferHeader, k: torch.Tensor, v: torch.Tensor) -> int:
        timeout = self._deadline.seconds(self._in_flight_bytes)
        stub = kv_grpc.KvTransferServiceStub(self._channel(dest_address))
        call = stub.Send(timeout=timeout)
        try:
            await call.write(kv_pb.KvChunk(header=_header_to_proto(header)))
            # No data before the receiver accepts the header: a refusal then ends the call with
            # nothing in flight (a write after the call's end would hide its status as INTERNAL).
            accepted = await call.initial_metadata()
            if accepted is not None and ACCEPTED_KEY in accepted:
                for part in (host_bytes(k), host_bytes(v)):
                    for start in range(0, len(part), self._chunk_bytes):
                        chunk = part[start : start + self._chunk_bytes].tobytes()
                        await call.write(kv_pb.KvChunk(data=chunk))
                await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call ended early: its status says why
        code = await call.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise TransferFailed(
                code.name,
                f"transfer {header.transfer_id!r} ({header.total_bytes} bytes) did not complete within its "
                f"deadline of {timeout:.1f} s (--transfer-deadline-floor, --transfer-deadline-bytes-per-s)",
            )
        if code != grpc.StatusCode.OK:
            raise TransferFailed(code.name, await call.details() or "")
        reply: kv_pb.KvReceived = await call
        return reply.bytes_received

    async def stop(self) -> None:
        for channel in self._channels.values():
            await channel.close(None)
        self._channels.clear()
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None

    def _channel(self, dest_address: str) -> grpc.aio.Channel:
        channel = self._channels.get(dest_address)
        if channel is None:
            if self._channel_creds is None:
                channel = grpc.aio.insecure_channel(dest_address, options=CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(dest_address, self._channel_creds, options=CHANNEL_OPTIONS)
            self._channels[dest_address] = channel
        return channel


def advertised_host(host: str) -> str:
    """The host other workers dial: the bound one, or this machine's name for a wildcard."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "[::]") else host


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _header_to_proto(header: TransferHeader) -> kv_pb.KvHeader:
    return kv_pb.KvHeader(
        transfer_id=header.transfer_id,
        dtype=header.dtype,
        shape=list(header.shape),
        total_bytes=header.total_bytes,
    )


class _Receiver(kv_grpc.KvTransferServiceServicer):
    """Takes transfers into `store`: the header reserves room and is accepted, the chunks fill one
    buffer, and K and V become views of it."""

    def __init__(self, store: TransferStore) -> None:
        self._store = store

    async def Send(
        self, request_iterator: AsyncIterator[kv_pb.KvChunk], context: grpc.aio.ServicerContext
    ) -> kv_pb.KvReceived:
        chunks = aiter(request_iterator)
        try:
            header = await self._accept(chunks)
        except BadTransfer as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TransferRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        try:
            await context.send_initial_metadata(ACCEPTED)
            received = await self._fill(header, chunks)
        except BadTransfer as exc:
            # Give the room back before the status goes out: the sender may look at once. Then read
            # what it still writes, so that it sees this status rather than a failed write (grpc.aio
            # reports a write after the call's end as INTERNAL).
            self._store.release(header.transfer_id)
            async for _ in chunks:
                pass
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except BaseException:  # a cancelled or broken stream
            self._store.release(header.transfer_id)
            raise
        return kv_pb.KvReceived(bytes_received=received, ok=True)

    async def _accept(self, chunks: AsyncIterator[kv_pb.KvChunk]) -> TransferHeader:
        first = await anext(chunks, None)
        if first is None or first.WhichOneof("msg") != "header":
            raise BadTransfer("the first message must be a header")
        h = first.header
        header = TransferHeader(h.transfer_id, h.dtype, tuple(h.shape), h.total_bytes)
        header.check()
        self._store.reserve(header)
        return header

    async def _fill(self, header: TransferHeader, chunks: AsyncIterator[kv_pb.KvChunk]) -> int:
        buffer = bytearray(header.total_bytes)
        view = memoryview(buffer)
        received = 0
        async for chunk in chunks:
            if chunk.WhichOneof("msg") != "data":
                raise BadTransfer(f"transfer {header.transfer_id!r}: a second header")
            end = received + len(chunk.data)
            if end > header.total_bytes:
                raise BadTransfer(
                    f"transfer {header.transfer_id!r}: more than total_bytes {header.total_bytes}"
                )
            view[received:end] = chunk.data
            received = end
        if received != header.total_bytes:
            raise BadTransfer(
                f"transfer {header.transfer_id!r}: {received} bytes, not total_bytes {header.total_bytes}"
            )
        self._store.complete(header.transfer_id, tensors_from(buffer, header))
        # Nothing else may happen on this worker for a while: release the copy at its deadline
        # if no step claimed it.
        asyncio.get_running_loop().call_later(self._store.hold_s + _EXPIRY_LAG_S, self._store.expire)
        return received
