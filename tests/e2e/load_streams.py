"""A streaming load in a process of its own: `python -m tests.e2e.load_streams ADDRESS CONNECTIONS
STREAMS [MAX_NEW_TOKENS]`. It keeps CONNECTIONS channels with STREAMS long greedy streams each open
(MAX_NEW_TOKENS each, a million by default; a stream that ends starts over), reads and drops every
message, and prints `ready` once every stream has had its first message. It runs until it is
killed."""

from __future__ import annotations

import asyncio
import sys

import grpc

from clients.client import generate_request, sampling_params
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc


async def _stream(stub: gen_grpc.GenerationStub, first: asyncio.Event, max_new_tokens: int) -> None:
    sampling = sampling_params(max_new_tokens=max_new_tokens, ignore_eos=True, temperature=0.0)
    while True:
        try:
            async for _ in stub.Generate(generate_request([5, 6, 7], sampling)):
                first.set()
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.1)


async def main(address: str, connections: int, streams: int, max_new_tokens: int) -> None:
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(connections)]
    firsts = [asyncio.Event() for _ in range(connections * streams)]
    tasks = [
        asyncio.create_task(
            _stream(gen_grpc.GenerationStub(channels[k % connections]), first, max_new_tokens)
        )
        for k, first in enumerate(firsts)
    ]
    await asyncio.gather(*(first.wait() for first in firsts))
    print("ready", flush=True)
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 1_000_000
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), tokens))
