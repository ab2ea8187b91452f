"""Live migration end to end: a worker's running requests leave it on SIGTERM, against today's ways.

    python bench/bench_migration.py downtime [--contexts 256 512 1024 2000] [--model DIR]
    python bench/bench_migration.py drain [--requests 32] [--context 1500] [--new 200] [--model DIR]
    python bench/bench_migration.py pressure [--requests 16] [--context 400] [--new 300] [--kv-tokens 6000]
    python bench/bench_migration.py random-checkpoint DIR [--layers 8] [--hidden 512] [--context 8192]
    python bench/bench_migration.py exit [--runs 3] [--model DIR]

Real processes on 127.0.0.1: a control plane and two workers (`stepwise up`'s Stack), the
embedded model unless --model. Every request carries one routing key, so all of them run on the
same worker (KV balancing off, `--disable-kv-balance`, so that none moves before); the bench sends it
SIGTERM while they decode, and the worker drains:

- `migrate`: the default; its running requests migrate to the other worker (pre-copy, then the tail);
- `recompute`: `--disable-drain-migration --drain-timeout 0`: they continue on the other worker at
  once by the hand-over, which prefills each one's prompt and streamed tokens again;
- `wait` (drain only): `--disable-drain-migration` with the default 30 s timeout: they finish where
  they are, and the worker leaves after them.

`downtime`: one request of each context length (random token ids), 64 new tokens, SIGTERM after
the 16th: the longest gap between two of its tokens at the client (the switch), against the
median gap (a decode step). `drain`: `--requests` requests of `--context` prompt tokens, SIGTERM once
each has 4 tokens: the seconds from SIGTERM until the worker exits, the longest gap any client saw,
prompt tokens the survivor computed (recomputation; one per migrated request is the continuation's
own), and the seconds until every stream ended. Wall-clock figures on a shared machine: run twice
and read them side by side.

`pressure`: `--requests` requests of `--context` prompt tokens and `--new` new ones, on one worker of
two that have `--kv-tokens` slots each, more than one holds; the control plane starts with a
new-token ratio of 0.1 (`STEPWISE_INIT_NEW_TOKEN_RATIO`: where the ratio of a server that has run a
while decays to), so admission overfills and decode must give way. Each worker computes on one thread
(`OMP_NUM_THREADS=1`), standing for a device of its own. `balance` (the default: requests
migrate to the other worker before and instead of a retraction) against `retract`
(`--disable-kv-balance`: SGLang's retraction, a re-prefill later): seconds until every stream ended,
requests retracted, prompt tokens computed beyond each prompt's first prefill (a migrated request's
continuation computes one), requests migrated, and the longest gap a client saw.

`exit`: the floor under a drain's exit time: a control plane and one idle worker; the seconds from
the worker's SIGTERM until its process has exited (nothing to drain), `--runs` times.

`random-checkpoint` writes a larger Llama checkpoint with random weights
(and the embedded tokenizer) for contexts past the embedded model's 2,048, or a prefill that costs
more.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from clients.client import StepwiseClient, generate_request, sampling_params
from stepwise.models import resolve_model
from stepwise.up import Stack

KEY = "bench"
MODES = {
    "migrate": [],
    "recompute": ["--disable-drain-migration", "--drain-timeout", "0"],
    "wait": ["--disable-drain-migration"],
}


async def _start(model: str, mode: str, kv_tokens: int) -> Stack:
    control = ["--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]
    # No KV balancing: a queue on the loaded worker would move requests to the other before the
    # SIGTERM, and the drain is what is measured.
    control += ["--model", model, "--disable-kv-balance", *MODES[mode]]
    worker = ["--log-level", "warning", "--model", model, "--kv-tokens", str(kv_tokens)]
    stack = Stack(control, worker, 2)
    await stack.start(timeout=180)
    return stack


async def _stream(client: StepwiseClient, ids: list[int], new: int, stamps: list[float]) -> int:
    """Stream one greedy request; a timestamp per token (chunks of k tokens stamp k times)."""
    request = generate_request(
        ids, sampling_params(max_new_tokens=new, temperature=0.0, ignore_eos=True), routing_key=KEY
    )
    async for response in client.stream(request):
        if response.WhichOneof("event") == "chunk":
            now = time.monotonic()
            stamps.extend([now] * len(response.chunk.token_ids))
    return len(stamps)


def _loaded_worker(stack: Stack, infos: list) -> object:  # type: ignore[type-arg]
    [busy] = [w for w in infos if w.running]
    return next(c for c in stack.children if c.name == busy.worker_id)


def _gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(stamps)]


async def downtime(model: str, contexts: list[int], mode: str) -> list[tuple[int, float, float]]:
    """(context, the longest gap, the median gap) in ms, one fresh stack per context."""
    rows = []
    for context in contexts:
        stack = await _start(model, mode, 4 * max(contexts) + 4096)
        try:
            rng = random.Random(context)
            ids = [rng.randrange(3, 1000) for _ in range(context)]
            stamps: list[float] = []
            async with StepwiseClient(stack.address) as client:
                task = asyncio.create_task(_stream(client, ids, 64, stamps))
                while len(stamps) < 16:
                    assert not task.done(), "the stream ended early"
                    await asyncio.sleep(0.002)
                child = _loaded_worker(stack, list((await client.server_info()).workers))
                child.proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
                await task
            gaps = _gaps(stamps)
            rows.append((context, 1e3 * max(gaps[15:]), 1e3 * statistics.median(gaps)))
        finally:
            stack.stop()
    return rows


async def drain(model: str, requests: int, context: int, new: int, mode: str) -> dict[str, float]:
    stack = await _start(model, mode, requests * (context + new) + 8192)
    try:
        rng = random.Random(requests)
        prompts = [[rng.randrange(3, 1000) for _ in range(context)] for _ in range(requests)]
        stamps: list[list[float]] = [[] for _ in prompts]
        async with StepwiseClient(stack.address) as client:
            tasks = [
                asyncio.create_task(_stream(client, p, new, s)) for p, s in zip(prompts, stamps, strict=True)
            ]
            while min(len(s) for s in stamps) < 4:
                assert not any(t.done() for t in tasks), "a stream ended early"
                await asyncio.sleep(0.005)
            child = _loaded_worker(stack, list((await client.server_info()).workers))
            start = time.monotonic()
            child.proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
            await asyncio.to_thread(child.proc.wait, 600)  # type: ignore[attr-defined]
            exit_s = time.monotonic() - start
            await asyncio.gather(*tasks)
            done_s = time.monotonic() - start
            [survivor] = (await client.server_info()).workers
        after = [[b - a for a, b in itertools.pairwise(s) if b > start] for s in stamps]
        return {
            "exit_s": exit_s,
            "max_gap_ms": 1e3 * max(max(g) for g in after if g),
            "recomputed": survivor.prompt_tokens_total - survivor.cached_tokens_total,
            "migrated": survivor.migrated_in,
            "all_done_s": done_s,
        }
    finally:
        stack.stop()


async def idle_exit(model: str) -> float:
    """Seconds from an idle worker's SIGTERM until its process has exited."""
    stack = await _start(model, "migrate", 4096)
    try:
        [child] = [c for c in stack.children if c.name.startswith("worker-0")]
        start = time.monotonic()
        child.proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        await asyncio.to_thread(child.proc.wait, 60)  # type: ignore[attr-defined]
        return time.monotonic() - start
    finally:
        stack.stop()


PRESSURE_MODES = {"balance": [], "retract": ["--disable-kv-balance"]}


async def pressure(
    model: str, requests: int, context: int, new: int, kv_tokens: int, mode: str
) -> dict[str, float]:
    control = ["--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]
    control += ["--model", model, *PRESSURE_MODES[mode]]
    worker = ["--log-level", "warning", "--model", model, "--kv-tokens", str(kv_tokens)]
    stack = Stack(control, worker, 2)
    os.environ["STEPWISE_INIT_NEW_TOKEN_RATIO"] = "0.1"
    os.environ["OMP_NUM_THREADS"] = "1"  # a worker a core: each stands for a device of its own
    try:
        await stack.start(timeout=180)
        rng = random.Random(requests)
        prompts = [[rng.randrange(3, 1000) for _ in range(context)] for _ in range(requests)]
        stamps: list[list[float]] = [[] for _ in prompts]
        start = time.monotonic()
        async with StepwiseClient(stack.address) as client:
            counts = await asyncio.gather(
                *(_stream(client, p, new, s) for p, s in zip(prompts, stamps, strict=True))
            )
            done_s = time.monotonic() - start
            workers = list((await client.server_info()).workers)
        assert counts == [new] * requests, counts
        computed = sum(w.prompt_tokens_total - w.cached_tokens_total for w in workers)
        return {
            "all_done_s": done_s,
            "retracted": sum(w.retractions for w in workers),
            "recomputed": computed - requests * context,
            "migrated": sum(w.migrated_out for w in workers),
            "max_gap_ms": 1e3 * max(max(_gaps(s)) for s in stamps),
        }
    finally:
        os.environ.pop("STEPWISE_INIT_NEW_TOKEN_RATIO", None)
        os.environ.pop("OMP_NUM_THREADS", None)
        stack.stop()


def random_checkpoint(out: Path, layers: int, hidden: int, context: int) -> None:
    """A Llama checkpoint with random weights and the embedded model's tokenizer (vocabulary 1,024)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    embedded = resolve_model("embedded")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    for path in embedded.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, out / path.name)
    print(f"wrote {out}: {layers} layers, hidden {hidden}, context {context}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    down = sub.add_parser("downtime")
    down.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2000])
    down.add_argument("--model", default="embedded")
    dr = sub.add_parser("drain")
    dr.add_argument("--requests", type=int, default=32)
    dr.add_argument("--context", type=int, default=1500)
    dr.add_argument("--new", type=int, default=200)
    dr.add_argument("--model", default="embedded")
    pr = sub.add_parser("pressure")
    pr.add_argument("--requests", type=int, default=16)
    pr.add_argument("--context", type=int, default=400)
    pr.add_argument("--new", type=int, default=300)
    pr.add_argument("--kv-tokens", type=int, default=6000)
    pr.add_argument("--model", default="embedded")
    ex = sub.add_parser("exit")
    ex.add_argument("--runs", type=int, default=3)
    ex.add_argument("--model", default="embedded")
    rc = sub.add_parser("random-checkpoint")
    rc.add_argument("out", type=Path)
    rc.add_argument("--layers", type=int, default=8)
    rc.add_argument("--hidden", type=int, default=512)
    rc.add_argument("--context", type=int, default=8192)
    ns = parser.parse_args()
    if ns.what == "random-checkpoint":
        random_checkpoint(ns.out, ns.layers, ns.hidden, ns.context)
        return
    model = str(resolve_model(ns.model))
    if ns.what == "downtime":
        results = {mode: asyncio.run(downtime(model, ns.contexts, mode)) for mode in ("migrate", "recompute")}
        print(f"{'context':>8} {'migrate max gap ms':>19} {'recompute max gap ms':>21} {'median gap ms':>14}")
        for (context, mig, med), (_, rec, _) in zip(results["migrate"], results["recompute"], strict=True):
            print(f"{context:>8} {mig:>19.1f} {rec:>21.1f} {med:>14.1f}")
        return
    if ns.what == "exit":
        seconds = [asyncio.run(idle_exit(model)) for _ in range(ns.runs)]
        print("idle worker's exit after SIGTERM, s: " + ", ".join(f"{x:.2f}" for x in seconds))
        return
    if ns.what == "pressure":
        print(
            f"{'mode':>8} {'all done s':>11} {'retracted':>10} {'recomputed':>11} {'migrated':>9} "
            f"{'max gap ms':>11}"
        )
        for mode in PRESSURE_MODES:
            r = asyncio.run(pressure(model, ns.requests, ns.context, ns.new, ns.kv_tokens, mode))
            print(
                f"{mode:>8} {r['all_done_s']:>11.2f} {r['retracted']:>10.0f} {r['recomputed']:>11.0f} "
                f"{r['migrated']:>9.0f} {r['max_gap_ms']:>11.1f}"
            )
        return
    print(
        f"{'mode':>10} {'exit s':>8} {'max gap ms':>11} {'recomputed':>11} {'migrated':>9} {'all done s':>11}"
    )
    for mode in ("migrate", "recompute", "wait"):
        r = asyncio.run(drain(model, ns.requests, ns.context, ns.new, mode))
        print(
            f"{mode:>10} {r['exit_s']:>8.2f} {r['max_gap_ms']:>11.1f} {r['recomputed']:>11.0f} "
            f"{r['migrated']:>9.0f} {r['all_done_s']:>11.2f}"
        )


if __name__ == "__main__":
    main()
