"""Worker-to-worker KV transfer over gRPC: two transports in this process on 127.0.0.1 ephemeral
ports; every byte arrives, and every malformed or refused transfer ends with its status code."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
import torch

from data_plane.kv_transfer import BadTransfer, TransferFailed, TransferHeader, TransferStore
from data_plane.kv_transfer_grpc import GrpcKvTransport, TlsFiles, _Receiver
from protos.stepwise.v1 import kv_transfer_pb2 as kv_pb
from protos.stepwise.v1 import kv_transfer_pb2_grpc as kv_grpc
from tests.certs import make_ca, make_cert

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


@pytest.fixture
async def start() -> AsyncIterator[Callable[..., object]]:
    """`transport, address = await start(buffer_bytes=..., tls=..., chunk_bytes=...)`; all stopped."""
    started: list[GrpcKvTransport] = []

    async def make(
        buffer_bytes: int = 64 * MiB, tls: TlsFiles | None = None, chunk_bytes: int = MiB
    ) -> tuple[GrpcKvTransport, str]:
        transport = GrpcKvTransport("127.0.0.1", 0, buffer_bytes, tls, chunk_bytes)
        started.append(transport)
        return transport, await transport.start()

    try:
        yield make
    finally:
        for transport in started:
            await transport.stop()


def _kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(a.view(torch.uint8).numpy()) == bytes(b.contiguous().view(torch.uint8).numpy())
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 256, 4, 16), (30, 33, 3, 64)])
async def test_round_trip_is_byte_identical(start, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    receiver, address = await start()
    sender, _ = await start()
    k, v = _kv(shape, dtype)
    received = await sender.send(address, "seq-1", k, v)
    assert received == 2 * k.numel() * k.element_size()
    copy = receiver.received.take("seq-1")
    assert _same_bytes(copy.k, k) and _same_bytes(copy.v, v)


async def test_many_tiny_chunks(start) -> None:
    receiver, address = await start()
    sender, _ = await start(chunk_bytes=7)  # 2 * 3 * 5 * 2 * 4 * 4 bytes: hundreds of chunks, uneven
    k, v = _kv((3, 5, 2, 4), torch.float32)
    assert await sender.send(address, "t", k, v) == 960
    copy = receiver.received.take("t")
    assert _same_bytes(copy.k, k) and _same_bytes(copy.v, v)


async def test_a_non_contiguous_tensor_goes_as_its_values(start) -> None:
    receiver, address = await start()
    sender, _ = await start()
    k, v = _kv((2, 8, 2, 4), torch.float16)
    await sender.send(address, "t", k[:, ::2], v[:, ::2])
    copy = receiver.received.take("t")
    assert _same_bytes(copy.k, k[:, ::2]) and _same_bytes(copy.v, v[:, ::2])


async def test_a_listener_hears_each_complete_transfer_while_it_listens(start) -> None:
    seen: list[tuple[str, int]] = []
    store = TransferStore(MiB)
    receiver = GrpcKvTransport("127.0.0.1", 0, 0, received=store)
    try:
        address = await receiver.start()
        sender, _ = await start()
        with store.listening(lambda transfer_id, nbytes: seen.append((transfer_id, nbytes))):
            await sender.send(address, "a", *_kv((1, 2, 1, 4), torch.float32))
        await sender.send(address, "b", *_kv((1, 2, 1, 4), torch.float32))
    finally:
        await receiver.stop()
    # K and V of 2 tokens, one head of 4 float32 values, one layer: 64 bytes; "b" came after the block.
    assert seen == [("a", 64)] and "a" in receiver.received and "b" in receiver.received


async def test_a_duplicate_transfer_id_is_invalid_argument(start) -> None:
    _, address = await start()
    sender, _ = await start()
    k, v = _kv((1, 4, 1, 8), torch.float32)
    await sender.send(address, "dup", k, v)
    with pytest.raises(TransferFailed) as err:
        await sender.send(address, "dup", k, v)
    assert err.value.code == "INVALID_ARGUMENT" and "transfer_id 'dup'" in err.value.details


async def test_a_full_buffer_refuses_and_frees_when_taken(start) -> None:
    k, v = _kv((2, 16, 2, 8), torch.float32)  # 4096 bytes a transfer
    receiver, address = await start(buffer_bytes=6000)
    sender, _ = await start()
    await sender.send(address, "one", k, v)
    with pytest.raises(TransferFailed) as err:
        await sender.send(address, "two", k, v)
    assert err.value.code == "FAILED_PRECONDITION" and "--transfer-buffer-bytes" in err.value.details
    receiver.received.take("one")
    assert receiver.received.used_bytes == 0
    await sender.send(address, "two", k, v)


async def test_a_receiver_with_no_buffer_refuses_everything(start) -> None:
    _, address = await start(buffer_bytes=0)
    sender, _ = await start()
    with pytest.raises(TransferFailed) as err:
        await sender.send(address, "t", *_kv((1, 1, 1, 1), torch.float16))
    assert err.value.code == "FAILED_PRECONDITION", err.value.details


def _header(**change: object) -> kv_pb.KvChunk:
    fields: dict[str, object] = {
        "transfer_id": "t",
        "dtype": "float32",
        "shape": [1, 2, 1, 4],
        "total_bytes": 64,
    }
    fields.update(change)
    return kv_pb.KvChunk(header=kv_pb.KvHeader(**fields))  # type: ignore[arg-type]


BAD_STREAMS = {
    "unknown dtype": ([_header(dtype="int8")], "dtype 'int8'"),
    "a shape of three sizes": ([_header(shape=[2, 1, 4], total_bytes=64)], "shape [2, 1, 4]"),
    "a zero size": ([_header(shape=[1, 0, 1, 4], total_bytes=0)], "shape [1, 0, 1, 4]"),
    "total_bytes not the shape's": ([_header(total_bytes=65)], "total_bytes 65"),
    "an empty transfer id": ([_header(transfer_id="")], "transfer_id ''"),
    "no header": ([kv_pb.KvChunk(data=b"x" * 64)], "first message must be a header"),
    "nothing at all": ([], "first message must be a header"),
    "too few bytes": ([_header(), kv_pb.KvChunk(data=b"x" * 63)], "63 bytes, not total_bytes 64"),
    "too many bytes": ([_header(), kv_pb.KvChunk(data=b"x" * 65)], "more than total_bytes 64"),
    "a second header": ([_header(), _header()], "a second header"),
}


@pytest.mark.parametrize("case", BAD_STREAMS)
async def test_a_malformed_stream_is_invalid_argument_and_holds_nothing(start, case: str) -> None:
    receiver, address = await start()
    messages, detail = BAD_STREAMS[case]
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv_grpc.KvTransferServiceStub(channel).Send(iter(messages), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert detail in (err.value.details() or "")
    assert receiver.received.used_bytes == 0


class _Aborted(Exception):
    pass


class _RecordingContext:
    """Stands in for the servicer context: `abort` notes what the store holds when the status goes
    out (a client may read the store as soon as it has the status) and ends the call."""

    def __init__(self, store: TransferStore) -> None:
        self._store = store
        self.held_at_abort: int | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.held_at_abort = self._store.used_bytes
        raise _Aborted(code, details)

    async def send_initial_metadata(self, metadata: object) -> None:
        pass


@pytest.mark.parametrize("case", BAD_STREAMS)
async def test_a_malformed_stream_holds_nothing_when_its_status_goes_out(case: str) -> None:
    # Releasing after the abort let a client that read the store at once see the reservation
    # (it failed one CI run in about 2,000 tests): nothing may be held when the status is sent.
    store = TransferStore(64 * MiB)
    context = _RecordingContext(store)
    messages, _ = BAD_STREAMS[case]

    async def stream() -> AsyncIterator[kv_pb.KvChunk]:
        for message in messages:
            yield message

    with pytest.raises(_Aborted):
        await _Receiver(store).Send(stream(), context)  # type: ignore[arg-type]
    assert context.held_at_abort == 0
    assert store.used_bytes == 0


def test_tensors_that_cannot_go_are_refused_before_sending() -> None:
    k = torch.zeros(1, 2, 1, 4)
    with pytest.raises(BadTransfer, match="k and v differ"):
        TransferHeader.of("t", k, torch.zeros(1, 3, 1, 4))
    with pytest.raises(BadTransfer, match="dtype 'int32'"):
        TransferHeader.of("t", k.int(), k.int())
    with pytest.raises(BadTransfer, match="shape"):
        TransferHeader.of("t", k[0], k[0])
    with pytest.raises(ValueError, match="chunk_bytes 0"):
        GrpcKvTransport("127.0.0.1", 0, 0, chunk_bytes=0)


# ---- mutual TLS ---------------------------------------------------------------------------------


def _tls(tmp: Path, ca_name: str, name: str) -> TlsFiles:
    ca = make_ca(tmp, ca_name)
    issued = make_cert(ca, tmp, name, server_and_client=True)
    return TlsFiles(ca.cert, issued.cert, issued.key)


async def test_mutual_tls_round_trip(start, tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    a, b = (make_cert(ca, tmp_path, n, server_and_client=True) for n in ("worker-a", "worker-b"))
    receiver, address = await start(tls=TlsFiles(ca.cert, a.cert, a.key))
    sender, _ = await start(tls=TlsFiles(ca.cert, b.cert, b.key))
    k, v = _kv((2, 3, 2, 8), torch.bfloat16)
    await sender.send(address, "t", k, v)
    assert _same_bytes(receiver.received.take("t").k, k)


async def test_a_client_without_a_certificate_is_refused(start, tmp_path: Path) -> None:
    tls = _tls(tmp_path, "ca", "worker-a")
    receiver, address = await start(tls=tls)
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca.read_bytes())
    async with grpc.aio.secure_channel(address, creds) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv_grpc.KvTransferServiceStub(channel).Send(iter([_header()]), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert receiver.received.used_bytes == 0


async def test_a_worker_of_another_ca_is_refused(start, tmp_path: Path) -> None:
    _, address = await start(tls=_tls(tmp_path / "ours", "ours", "worker-a"))
    stranger, _ = await start(tls=_tls(tmp_path / "theirs", "theirs", "worker-x"))
    with pytest.raises(TransferFailed) as err:
        await stranger.send(address, "t", *_kv((1, 1, 1, 4), torch.float32))
    assert err.value.code == "UNAVAILABLE"


async def test_a_plaintext_sender_is_refused(start, tmp_path: Path) -> None:
    _, address = await start(tls=_tls(tmp_path, "ca", "worker-a"))
    plain, _ = await start()
    with pytest.raises(TransferFailed) as err:
        await plain.send(address, "t", *_kv((1, 1, 1, 4), torch.float32))
    assert err.value.code == "UNAVAILABLE"
