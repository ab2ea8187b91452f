"""How long a worker sits idle between steps, with one or two plans in flight.

    python bench/bench_pipeline.py [--batch 32] [--steps 200] [--backend model|sim] [--think-ms 0]

Starts a real worker process (`python -m data_plane.worker`, the embedded model on CPU by default)
against a fake control plane in this process. The control plane prefills `--batch` prompts, then
sends `--steps` decode plans (encoded by a PlanEncoder: deltas, as a real link sends them), keeping
1 or 2 plans in flight, and waits `--think-ms` after each result before sending the next plan (a
stand-in for the scheduler's own time per step). Idle is the worker's own `wait_s` summed over the
decode steps, as a share of the wall time of those steps.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from protos import worker_codec
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.stepwise.v1 import worker_pb2_grpc as wk_grpc
from protos.worker import DecodeWork, ExtendWork, NewSeq, SamplerParams, Shutdown, StepKind, StepPlan, Welcome

REPO = pathlib.Path(__file__).resolve().parents[1]
PROMPT_LEN = 16


def make_plans(batch: int, steps: int) -> list[StepPlan]:
    """A prefill of `batch` prompts, then `steps` decodes of all of them (sequence b owns a block)."""
    rng = np.random.default_rng(0)
    span = PROMPT_LEN + steps + 1
    handles = np.arange(1, batch + 1, dtype=np.int64)
    prompt_slots = (np.arange(batch)[:, None] * span + np.arange(PROMPT_LEN)[None, :]).reshape(-1)
    prefill = StepPlan(
        1,
        StepKind.PREFILL,
        new_seqs=tuple(NewSeq(int(h), SamplerParams(temperature=0.0), request_id=f"r{h}") for h in handles),
        extends=ExtendWork(
            handles=handles,
            starts=np.zeros(batch, np.int32),
            lens=np.full(batch, PROMPT_LEN, np.int32),
            sample=np.ones(batch, bool),
            token_ids=rng.integers(3, 1000, size=batch * PROMPT_LEN).astype(np.int32),
            slots=prompt_slots.astype(np.int64),
        ),
    )
    decodes = [
        StepPlan(
            2 + i,
            StepKind.DECODE,
            decodes=DecodeWork(
                handles=handles, slots=np.arange(batch, dtype=np.int64) * span + PROMPT_LEN + i
            ),
        )
        for i in range(steps)
    ]
    return [prefill, *decodes]


class FakeControl(wk_grpc.WorkerLinkServicer):
    def __init__(self, plans: list[StepPlan], in_flight: int, think_s: float) -> None:
        self.plans, self.in_flight, self.think_s = plans, in_flight, think_s
        self.results: list[wk_pb.StepResult] = []
        self.received: list[float] = []
        self.done = asyncio.Event()

    async def Connect(
        self, request_iterator: AsyncIterator[wk_pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wk_pb.ControlMessage]:
        replies = aiter(request_iterator)
        await anext(replies)  # the hello
        yield worker_codec.control_to_proto(Welcome(True))
        encoder = worker_codec.PlanEncoder()
        yield encoder.encode(self.plans[0])
        self._note(await anext(replies))  # the prefill, alone
        pending = iter(self.plans[1:])
        for plan in [next(pending) for _ in range(self.in_flight)]:
            yield encoder.encode(plan)
        for plan in pending:
            self._note(await anext(replies))
            await asyncio.sleep(self.think_s)
            yield encoder.encode(plan)
        for _ in range(self.in_flight):
            self._note(await anext(replies))
        yield worker_codec.control_to_proto(Shutdown("bench over"))
        self.done.set()

    def _note(self, msg: wk_pb.WorkerMessage) -> None:
        assert not msg.result.error, msg.result.error
        self.results.append(msg.result)
        self.received.append(time.perf_counter())


async def run(args: argparse.Namespace, in_flight: int) -> tuple[float, float]:
    """(idle share of the decode steps' wall time, decode steps per second)."""
    control = FakeControl(make_plans(args.batch, args.steps), in_flight, args.think_ms / 1000)
    server = grpc.aio.server()
    wk_grpc.add_WorkerLinkServicer_to_server(control, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "data_plane.worker", "--control", f"127.0.0.1:{port}", "--model", args.model,
        "--backend", args.backend, "--kv-tokens", str(args.batch * (PROMPT_LEN + args.steps + 1) + 64),
        cwd=REPO, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await asyncio.wait_for(control.done.wait(), 600)
        await worker.wait()
    finally:
        if worker.returncode is None:
            worker.kill()
        await server.stop(None)
    decode = control.results[2:]  # after the prefill and the first decode (warm-up)
    wall = control.received[-1] - control.received[1]
    return sum(r.wait_s for r in decode) / wall, len(decode) / wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(REPO / "stepwise/assets/embedded"))
    parser.add_argument("--backend", default="model", choices=["model", "sim"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--think-ms", type=float, default=0.0, help="control-plane time per result")
    args = parser.parse_args(argv)
    print(f"{args.backend} worker, batch {args.batch}, {args.steps} decode steps, think {args.think_ms} ms")
    for in_flight in (1, 2):
        idle, rate = asyncio.run(run(args, in_flight))
        print(f"{in_flight} in flight: worker idle {idle:6.1%} of wall time, {rate:7.1f} steps/s")


if __name__ == "__main__":
    main()
