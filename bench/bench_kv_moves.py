"""Moving a running sequence's KV between two workers' executors with plan ops, against recomputing it.

    python bench/bench_kv_moves.py [--contexts 256 512 1024 2000] [--repeats 5]

Two executors over the embedded model (float32, CPU) in this process, each with a real gRPC
transport on 127.0.0.1 (data_plane/kv_transfer_grpc.py). For each context length a sequence is
prefilled and decoded on the source; then, per repeat:

- the source's decode step with and without a `KvSend` of the whole context (the send's snapshot is
  the only extra work the step does: the bytes go in the background);
- the time from that step's start until the source's outcome says the destination holds the bytes;
- the destination's step that receives them (`KvReceive`) and extends the last token over them,
  against the step that prefills the whole context from its tokens (what a hand-over does today).

Prints milliseconds (medians over the repeats) and the CPU seconds of this process per repeat (every
thread, from /proc/self/stat), side by side. This is the worker side of a migration's downtime: the
control plane's part (planning, the two plan round trips) comes on top.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from data_plane.executor import Executor
from data_plane.kv_pool import KvPool
from data_plane.kv_transfer import TransferAgent
from data_plane.kv_transfer_grpc import GrpcKvTransport
from data_plane.models.llama import LlamaModel
from protos.worker import (
    DecodeWork,
    ExtendWork,
    KvReceive,
    KvSend,
    NewSeq,
    SamplerParams,
    StepKind,
    StepPlan,
    StepResult,
)
from stepwise.models import resolve_model

CAPACITY = 8192


def cpu_s() -> float:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(executor: Executor, plan: StepPlan) -> StepResult:
    result = executor.execute(plan)
    if result.error:
        raise RuntimeError(result.error)
    return result


def extend_plan(
    step: int, handle: int, start: int, tokens: list[int], slots: np.ndarray, prefix: np.ndarray
) -> StepPlan:
    return StepPlan(
        step_id=step,
        kind=StepKind.PREFILL,
        new_seqs=(NewSeq(handle, SamplerParams(), prefix, np.zeros(0, np.int32)),),
        extends=ExtendWork(
            handles=np.array([handle], np.int64),
            starts=np.array([start], np.int32),
            lens=np.array([len(tokens)], np.int32),
            sample=np.array([True]),
            token_ids=np.array(tokens, np.int32),
            slots=slots,
        ),
    )


def decode_plan(step: int, handle: int, slot: int) -> StepPlan:
    return StepPlan(
        step_id=step,
        kind=StepKind.DECODE,
        decodes=DecodeWork(handles=np.array([handle], np.int64), slots=np.array([slot], np.int64)),
    )


async def measure(contexts: list[int], repeats: int) -> None:
    model = LlamaModel.from_dir(resolve_model("embedded"), torch.device("cpu"), torch.float32)
    source = Executor(model, KvPool(model.config, CAPACITY, torch.float32, torch.device("cpu")))
    dest = Executor(model, KvPool(model.config, CAPACITY, torch.float32, torch.device("cpu")))
    transports = [GrpcKvTransport("127.0.0.1", 0, 1 << 30) for _ in range(2)]
    await transports[0].start()
    address = await transports[1].start()
    loop = asyncio.get_running_loop()
    source.transfers = TransferAgent(transports[0], loop)
    dest.transfers = TransferAgent(transports[1], loop)
    per_token = 2 * source.pool.k[:, 0].numel() * source.pool.k.element_size()
    print(f"embedded model, float32, {per_token} B of K and V per token; medians of {repeats} repeats")
    print(
        f"{'context':>8} {'decode ms':>10} {'+send ms':>9} {'delivered ms':>13} "
        f"{'receive+1 ms':>13} {'re-prefill ms':>14} {'cpu s/move':>11} {'cpu s/re-prefill':>17}"
    )
    step = 0
    try:
        for context in contexts:
            rng = np.random.default_rng(context)
            tokens = rng.integers(1, model.config.vocab_size, context).tolist()
            src_slots = np.arange(context, dtype=np.int64)
            step += 1
            run(source, extend_plan(step, 1, 0, tokens, src_slots, np.zeros(0, np.int64)))
            plain, with_send, delivered, receive, prefill, move_cpu, prefill_cpu = [], [], [], [], [], [], []
            for r in range(repeats):
                slot = context + 2 * r
                step += 1
                t0 = time.perf_counter()
                run(source, decode_plan(step, 1, slot))
                plain.append(time.perf_counter() - t0)
                c0 = cpu_s()
                step += 1
                transfer_id = f"ctx{context}-{r}"
                t0 = time.perf_counter()
                n = context + 2 * r + 1  # positions with KV written so far (position p is in slot p)
                plan = dataclasses.replace(
                    decode_plan(step, 1, slot + 1),
                    sends=(KvSend(transfer_id, address, np.arange(n, dtype=np.int64)),),
                )
                run(source, plan)
                with_send.append(time.perf_counter() - t0)
                while True:
                    step += 1
                    outcomes = run(source, StepPlan(step_id=step, kind=StepKind.DECODE)).transfers
                    if outcomes:
                        break
                    await asyncio.sleep(0)
                if outcomes[0].error:
                    raise RuntimeError(outcomes[0].error)
                delivered.append(time.perf_counter() - t0)
                dest_slots = np.arange(n, dtype=np.int64)
                t0 = time.perf_counter()
                step += 1
                plan = extend_plan(step, 10 + r, n, [tokens[-1]], np.array([n], np.int64), dest_slots)
                run(dest, dataclasses.replace(plan, receives=(KvReceive(transfer_id, dest_slots),)))
                receive.append(time.perf_counter() - t0)
                move_cpu.append(cpu_s() - c0)
                step += 1
                run(dest, StepPlan(step_id=step, kind=StepKind.DECODE, releases=np.array([10 + r], np.int64)))
                c0 = cpu_s()
                full = tokens + [tokens[-1]] * (n + 1 - context)
                t0 = time.perf_counter()
                step += 1
                run(
                    dest,
                    extend_plan(
                        step, 100 + r, 0, full, np.arange(n + 1, dtype=np.int64), np.zeros(0, np.int64)
                    ),
                )
                prefill.append(time.perf_counter() - t0)
                prefill_cpu.append(cpu_s() - c0)
                step += 1
                run(
                    dest, StepPlan(step_id=step, kind=StepKind.DECODE, releases=np.array([100 + r], np.int64))
                )
            step += 1
            run(source, StepPlan(step_id=step, kind=StepKind.DECODE, releases=np.array([1], np.int64)))
            med = statistics.median
            print(
                f"{context:>8} {med(plain) * 1e3:>10.2f} {med(with_send) * 1e3:>9.2f} "
                f"{med(delivered) * 1e3:>13.2f} {med(receive) * 1e3:>13.2f} {med(prefill) * 1e3:>14.2f} "
                f"{med(move_cpu):>11.3f} {med(prefill_cpu):>17.3f}"
            )
    finally:
        for transport in transports:
            await transport.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2000], help="tokens")
    parser.add_argument("--repeats", type=int, default=5, help="moves per context length")
    args = parser.parse_args()
    if max(args.contexts) + 2 * args.repeats + 2 > 2048:
        parser.error("--contexts: the embedded model's context is 2048 tokens (with 2 per repeat on top)")
    asyncio.run(measure(args.contexts, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
