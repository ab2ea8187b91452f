"""KV transfer throughput between two worker transports on loopback, against a plain gRPC byte stream.

    python bench/bench_kv_transfer.py [--min-bytes 268435456] [--chunk-bytes 1048576]

A receiver process serves a `GrpcKvTransport` (data_plane/kv_transfer_grpc.py; each transfer is
taken from its store as it completes) and a bare client-streaming gRPC method that only counts the
bytes it is sent. This process sends K/V of each shape to both, the same bytes in the same chunk
size, enough transfers to move at least `--min-bytes`, one at a time. Prints MB/s (10^6 bytes of K
and V per second of wall time) and the CPU seconds each process spent per GB (every thread, from
/proc/PID/stat), side by side. Shapes: 256 and 4096 tokens of the embedded model (float32), and
1024 tokens of an 8B-class model (32 layers, 8 KV heads, head_dim 128, bfloat16). Plaintext only.
The bench stops the process it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from data_plane.kv_transfer import TransferStore, host_bytes
from data_plane.kv_transfer_grpc import DEFAULT_CHUNK_BYTES, MESSAGE_OPTIONS, GrpcKvTransport

PLAIN = "/bench.Bytes/Stream"
SHAPES = {
    "embedded 256 tok f32": ((4, 256, 2, 32), torch.float32),
    "embedded 4096 tok f32": ((4, 4096, 2, 32), torch.float32),
    "8B-class 1024 tok bf16": ((32, 1024, 8, 128), torch.bfloat16),
}


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process `pid`, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the receiver process --------------------------------------------------------------------------


async def _count(chunks: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    total = 0
    async for chunk in chunks:
        total += len(chunk)
    return str(total).encode()


async def receive() -> None:
    def discard(transfer_id: str, _nbytes: int) -> None:
        store.take(transfer_id)

    store = TransferStore(1 << 34)
    transport = GrpcKvTransport("127.0.0.1", 0, 0, received=store)
    kv_address = await transport.start()
    plain = grpc.aio.server(options=MESSAGE_OPTIONS)
    handler = grpc.stream_unary_rpc_method_handler(_count)
    plain.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Bytes", {"Stream": handler})])
    port = plain.add_insecure_port("127.0.0.1:0")
    await plain.start()
    print(json.dumps({"kv": kv_address, "plain": f"127.0.0.1:{port}"}), flush=True)
    with store.listening(discard):
        await asyncio.Event().wait()


# ---- the sender (this process) -------------------------------------------------------------------


async def send_plain(channel: grpc.aio.Channel, k: torch.Tensor, v: torch.Tensor, chunk: int) -> None:
    call = channel.stream_unary(PLAIN)()
    for part in (host_bytes(k), host_bytes(v)):
        for start in range(0, len(part), chunk):
            await call.write(part[start : start + chunk].tobytes())
    await call.done_writing()
    await call


async def measure(args: argparse.Namespace, addresses: dict[str, str], pid: int) -> None:
    sender = GrpcKvTransport("127.0.0.1", 0, 0, chunk_bytes=args.chunk_bytes)
    channel = grpc.aio.insecure_channel(addresses["plain"], options=MESSAGE_OPTIONS)
    print(
        f"chunk {args.chunk_bytes} bytes, at least {args.min_bytes / 1e6:.0f} MB a row, one at a time",
    )
    print(
        f"{'shape':<24}{'MB each':>9}{'n':>5}  {'kv MB/s':>9}{'plain MB/s':>11}  "
        f"{'kv CPU s/GB send+recv':>22}{'plain CPU s/GB':>16}"
    )
    try:
        await sender.send(addresses["kv"], "warm-up", torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))
        for name, (shape, dtype) in SHAPES.items():
            k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
            size = 2 * k.numel() * k.element_size()
            n = max(3, -(-args.min_bytes // size))
            rows = []
            for kind in ("kv", "plain"):
                cpu0, peer0, t0 = cpu_s(os.getpid()), cpu_s(pid), time.perf_counter()
                for i in range(n):
                    if kind == "kv":
                        await sender.send(addresses["kv"], f"{name}-{i}".replace(" ", "_"), k, v)
                    else:
                        await send_plain(channel, k, v, args.chunk_bytes)
                wall = time.perf_counter() - t0
                gb = n * size / 1e9
                ours, theirs = (cpu_s(os.getpid()) - cpu0) / gb, (cpu_s(pid) - peer0) / gb
                rows.append((n * size / 1e6 / wall, ours, theirs))
            (kv_rate, kv_s, kv_r), (pl_rate, pl_s, pl_r) = rows
            print(
                f"{name:<24}{size / 1e6:>9.2f}{n:>5}  {kv_rate:>9.0f}{pl_rate:>11.0f}  "
                f"{f'{kv_s:.2f}+{kv_r:.2f}':>22}{f'{pl_s:.2f}+{pl_r:.2f}':>16}"
            )
    finally:
        await channel.close(None)
        await sender.stop()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--min-bytes", type=int, default=256 * 1024 * 1024, help="bytes sent per row, at least"
    )
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="bytes per message")
    parser.add_argument("--receive", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        asyncio.run(receive())
        return 0
    child = subprocess.Popen([sys.executable, __file__, "--receive"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        addresses = json.loads(child.stdout.readline())
        asyncio.run(measure(args, addresses, child.pid))
    finally:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
