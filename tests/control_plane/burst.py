"""A burst of new calls: `python -m tests.control_plane.burst PORT CALLS` connects four channels (a
TCP connection each), makes one warm-up call on each, then sends CALLS unary calls of
`/burst.Burst/Call` at once, prints how many were answered and exits."""

from __future__ import annotations

import asyncio
import sys

import grpc


async def main(port: int, calls: int) -> None:
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(4)]
    stubs = [channel.unary_unary("/burst.Burst/Call", None, None) for channel in channels]
    for stub in stubs:
        await stub(b"warm-up")
    answers = await asyncio.gather(*(stubs[i % 4](b"call") for i in range(calls)))
    print(sum(answer == b"ok" for answer in answers), flush=True)
    for channel in channels:
        await channel.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
