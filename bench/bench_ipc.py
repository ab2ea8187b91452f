"""Which IPC for the frontend-core link? pyzmq (SGLang's choice) against asyncio's own Unix streams.

Two processes on one machine, each with an asyncio loop, as the link has them. Two patterns:
- ping-pong: one frame, its echo, then the next (latency, and CPU per frame on each end);
- stream: the core side sends frames back to back, the other reads them (CPU per frame when
  batches flow one way, as token batches do).
Frames are 2 KB, about a step's token batch for a few hundred streams.

    python bench/bench_ipc.py            # needs pyzmq (a dev dependency)
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import struct
import sys
import tempfile
import time

FRAMES = 20000
PAYLOAD = b"x" * 2048
HEADER = struct.Struct("<I")


async def _zmq_peer(address: str, mode: str, ready: object) -> float:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    ready.set()  # type: ignore[attr-defined]
    started = time.process_time()
    for _ in range(FRAMES):
        ident, frame = await sock.recv_multipart()
        if mode == "pingpong":
            await sock.send_multipart([ident, frame])
    return time.process_time() - started


async def _zmq_driver(address: str, mode: str) -> tuple[list[float], float]:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    latencies, started = [], time.process_time()
    for _ in range(FRAMES):
        t = time.perf_counter()
        await sock.send(PAYLOAD)
        if mode == "pingpong":
            await sock.recv()
            latencies.append(time.perf_counter() - t)
    return latencies, time.process_time() - started


async def _uds_peer(path: str, mode: str, ready: object) -> float:
    done = asyncio.Event()
    cpu = [0.0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        started = time.process_time()
        for _ in range(FRAMES):
            header = await reader.readexactly(HEADER.size)
            frame = await reader.readexactly(HEADER.unpack(header)[0])
            if mode == "pingpong":
                writer.write(header + frame)
        await writer.drain()
        cpu[0] = time.process_time() - started
        done.set()

    server = await asyncio.start_unix_server(handle, path)
    ready.set()  # type: ignore[attr-defined]
    await done.wait()
    server.close()
    return cpu[0]


async def _uds_driver(path: str, mode: str) -> tuple[list[float], float]:
    reader, writer = await asyncio.open_unix_connection(path)
    latencies, started = [], time.process_time()
    frame = HEADER.pack(len(PAYLOAD)) + PAYLOAD
    for _ in range(FRAMES):
        t = time.perf_counter()
        writer.write(frame)
        if mode == "pingpong":
            header = await reader.readexactly(HEADER.size)
            await reader.readexactly(HEADER.unpack(header)[0])
            latencies.append(time.perf_counter() - t)
        elif writer.transport.get_write_buffer_size() > 1 << 20:
            await writer.drain()
    await writer.drain()
    return latencies, time.process_time() - started


def _peer(kind: str, where: str, mode: str, ready: object, out: object) -> None:
    run = _zmq_peer if kind == "zmq" else _uds_peer
    out.put(asyncio.run(run(where, mode, ready)))  # type: ignore[attr-defined]


def measure(kind: str, mode: str, directory: str) -> dict[str, float]:
    where = f"ipc://{directory}/{kind}-{mode}" if kind == "zmq" else f"{directory}/{kind}-{mode}.sock"
    ctx = multiprocessing.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    peer = ctx.Process(target=_peer, args=(kind, where, mode, ready, out))
    peer.start()
    ready.wait(30)
    driver = _zmq_driver if kind == "zmq" else _uds_driver
    latencies, driver_cpu = asyncio.run(driver(where, mode))
    peer_cpu = out.get(timeout=60)
    peer.join(10)
    row = {
        "sender_cpu_us_per_frame": round(driver_cpu / FRAMES * 1e6, 1),
        "receiver_cpu_us_per_frame": round(peer_cpu / FRAMES * 1e6, 1),
    }
    if latencies:
        latencies.sort()
        row["rtt_p50_us"] = round(latencies[len(latencies) // 2] * 1e6, 1)
        row["rtt_p99_us"] = round(latencies[int(len(latencies) * 0.99)] * 1e6, 1)
    return row


def main() -> None:
    try:
        import zmq  # noqa: F401
    except ImportError:
        sys.exit("bench_ipc.py needs pyzmq: pip install pyzmq")
    with tempfile.TemporaryDirectory() as directory:
        results = {
            f"{kind} {mode}": measure(kind, mode, directory)
            for mode in ("pingpong", "stream")
            for kind in ("zmq", "uds")
        }
    print(
        json.dumps(
            {"frames": FRAMES, "frame_bytes": len(PAYLOAD), "cpus": os.cpu_count(), **results}, indent=2
        )
    )


if __name__ == "__main__":
    main()
