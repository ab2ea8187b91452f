"""Async client library for the Generation service."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc

FINISH_NAMES = {
    gen_pb.FINISH_REASON_STOP: "stop",
    gen_pb.FINISH_REASON_LENGTH: "length",
    gen_pb.FINISH_REASON_ABORT: "abort",
}


@dataclass(slots=True)
class Generation:
    """A finished generation, collected from the stream."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    finish_message: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0


def sampling_params(
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    seed: int | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    n: int | None = None,
) -> gen_pb.SamplingParams:
    """Build SamplingParams, leaving unset what the caller did not give (server defaults apply)."""
    msg = gen_pb.SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    optional = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
        "repetition_penalty": repetition_penalty,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "n": n,
    }
    for name, value in optional.items():
        if value is not None:
            setattr(msg, name, value)
    return msg


def generate_request(
    prompt: str | Sequence[int],
    sampling: gen_pb.SamplingParams | None = None,
    request_id: str = "",
    routing_key: str = "",
    priority: int | None = None,
) -> gen_pb.GenerateRequest:
    req = gen_pb.GenerateRequest(request_id=request_id, routing_key=routing_key, sampling=sampling)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.input_ids.ids.extend(prompt)
    if priority is not None:
        req.priority = priority
    return req


class StepwiseClient:
    """`async with StepwiseClient("127.0.0.1:50051") as client: ...`"""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = gen_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> StepwiseClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close(None)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until health says SERVING (a worker is attached); TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.address} not serving after {timeout:.0f} s")
            await asyncio.sleep(0.1)

    def stream(self, request: gen_pb.GenerateRequest) -> AsyncIterator[gen_pb.GenerateResponse]:
        """The raw response stream (cancel it to abort the request)."""
        return self.stub.Generate(request)  # type: ignore[no-any-return]

    async def generate(
        self,
        prompt: str | Sequence[int],
        request_id: str = "",
        routing_key: str = "",
        priority: int | None = None,
        **sampling: Any,
    ) -> Generation:
        """Run one generation to the end and collect it; `sampling` takes sampling_params()'s arguments."""
        request = generate_request(prompt, sampling_params(**sampling), request_id, routing_key, priority)
        return await collect(self.stream(request))

    async def generate_samples(
        self, prompt: str | Sequence[int], n: int, request_id: str = "", **sampling: Any
    ) -> list[Generation]:
        """n parallel samples of one prompt (one Generate call); returned in index order."""
        request = generate_request(prompt, sampling_params(n=n, **sampling), request_id)
        gens = [Generation() for _ in range(n)]
        async for response in self.stream(request):
            event = response.chunk if response.WhichOneof("event") == "chunk" else response.finished
            apply_response(gens[event.index], response)
        return gens

    async def abort(self, request_id: str) -> bool:
        reply = await self.stub.Abort(gen_pb.AbortRequest(request_id=request_id))
        return bool(reply.found)

    async def server_info(self) -> gen_pb.ServerInfo:
        return await self.stub.GetServerInfo(gen_pb.GetServerInfoRequest())


def apply_response(gen: Generation, response: gen_pb.GenerateResponse) -> None:
    gen.request_id = response.request_id
    if response.WhichOneof("event") == "chunk":
        gen.token_ids.extend(response.chunk.token_ids)
        gen.text += response.chunk.text
        return
    fin = response.finished
    gen.finish_reason = FINISH_NAMES.get(fin.reason, "unspecified")
    gen.finish_message = fin.message
    gen.prompt_tokens = fin.usage.prompt_tokens
    gen.cached_tokens = fin.usage.cached_tokens
    gen.completion_tokens = fin.usage.completion_tokens
    gen.queue_s, gen.ttft_s, gen.total_s = fin.timings.queue_s, fin.timings.ttft_s, fin.timings.total_s


async def collect(stream: AsyncIterator[gen_pb.GenerateResponse]) -> Generation:
    gen = Generation()
    async for response in stream:
        apply_response(gen, response)
    return gen
