"""Streams that read and drop, as fast as they can: `python -m tests.clients.flood PORT CONNECTIONS
STREAMS` keeps CONNECTIONS channels with STREAMS calls of `/flood.Flood/Stream` each open (a call
that ends starts over) until it is killed."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import grpc


async def main(port: int, connections: int, streams: int) -> None:
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(connections)]

    async def read(channel: grpc.aio.Channel) -> None:
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for _ in channel.unary_stream("/flood.Flood/Stream", None, None)(b""):
                    pass

    await asyncio.gather(*(read(channels[k % connections]) for k in range(connections * streams)))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
