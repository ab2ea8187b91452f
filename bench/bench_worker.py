"""Worker decode throughput next to transformers' own decode loop, on the embedded model.

    python bench/bench_worker.py [--batches 1 8 64] [--prompt-len 64] [--steps 32] [--device cpu]

For each batch size: prefill that many random prompts, then time `--steps` decode steps.
Ours drives the Executor with decode plans (built before timing: planning is the control
plane's cost, not the worker's), which includes input resolution, the forward and sampling.
transformers runs `model(input_ids, past_key_values=cache)` with a DynamicCache on the same batch
and picks the argmax. Both are greedy and do the same number of forwards. Output: tokens/s each
(ours with and without the decode cache, see data_plane/decode_cache.py), the ratio
ours / transformers, and the per-step milliseconds of all three.

    python bench/bench_worker.py --logprobs [--batches 1 8 64] ...

Instead: the cost of logprobs on the decode step. For each batch size, ours decodes the same
workload three ways, side by side: no logprobs, logprobs (the sampled token's only) and
top_logprobs=20 (SamplerParams.logprobs=21). Output: tokens/s and CPU time per token
(time.process_time, all threads) of each, and the ratio of each CPU time to the no-logprobs one.

    python bench/bench_worker.py --constrained [--batches 1 32 128] ...

Instead: the cost of constrained decoding (data_plane/constraints.py) on the decode step. For each
batch size, 0%, 50% and 100% of the sequences are held to a JSON schema (an array of at least
64 short strings, so no grammar finishes within the timed steps and every step fills real
masks), side by side. Output: tokens/s and CPU time per token of each, and each CPU time's
ratio to the unconstrained one.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from data_plane.backends import make_backend
from data_plane.constraints import Constraints
from data_plane.executor import Executor
from data_plane.kv_pool import KvPool
from data_plane.models.llama import LlamaModel
from protos.worker import DecodeWork, ExtendWork, Grammar, NewSeq, SamplerParams, StepKind, StepPlan
from stepwise.models import resolve_model


@dataclass(frozen=True, slots=True)
class Workload:
    batch: int
    prompt_len: int
    steps: int
    prompts: np.ndarray  # [batch, prompt_len] int64

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.steps + 1

    def slots(self, position: int) -> np.ndarray:
        """Slot of `position` for every sequence: sequence b owns [b * max_len, (b + 1) * max_len)."""
        return np.arange(self.batch, dtype=np.int64) * self.max_len + position


def make_workload(batch: int, prompt_len: int, steps: int, vocab: int, seed: int = 0) -> Workload:
    prompts = np.random.default_rng(seed).integers(1, vocab, size=(batch, prompt_len))
    return Workload(batch, prompt_len, steps, prompts.astype(np.int64))


def prefill_plan(w: Workload, sampler: SamplerParams | list[SamplerParams] | None = None) -> StepPlan:
    """The workload's prefill, every sequence sampling with `sampler` (or sequence i with sampler[i])."""
    handles = np.arange(w.batch, dtype=np.int64)
    positions = np.arange(w.prompt_len)
    samplers = sampler if isinstance(sampler, list) else [sampler or SamplerParams()] * w.batch
    return StepPlan(
        step_id=0,
        kind=StepKind.PREFILL,
        new_seqs=tuple(
            NewSeq(handle=int(h), sampler=s, prompt_len=w.prompt_len)
            for h, s in zip(handles, samplers, strict=True)
        ),
        extends=ExtendWork(
            handles=handles,
            starts=np.zeros(w.batch, dtype=np.int64),
            lens=np.full(w.batch, w.prompt_len, dtype=np.int64),
            sample=np.ones(w.batch, dtype=np.bool_),
            token_ids=w.prompts.reshape(-1),
            slots=(np.arange(w.batch)[:, None] * w.max_len + positions[None, :]).reshape(-1),
        ),
    )


def decode_plans(w: Workload) -> list[StepPlan]:
    handles = np.arange(w.batch, dtype=np.int64)
    return [
        StepPlan(1 + i, StepKind.DECODE, decodes=DecodeWork(handles=handles, slots=w.slots(w.prompt_len + i)))
        for i in range(w.steps)
    ]


def ours_tokens_per_s(
    model: LlamaModel, w: Workload, device: torch.device, decode_cache: bool = True, backend: str = "sdpa"
) -> float:
    """Decode tokens/s of the Executor (attention `backend`, data_plane/backends) after a prefill of
    the workload's prompts."""
    return ours_decode_cost(model, w, device, decode_cache=decode_cache, backend=backend)[0]


def ours_decode_cost(
    model: LlamaModel,
    w: Workload,
    device: torch.device,
    sampler: SamplerParams | list[SamplerParams] | None = None,
    decode_cache: bool = True,
    backend: str = "sdpa",
    constraints: Constraints | None = None,
) -> tuple[float, float]:
    """(decode tokens/s, CPU seconds per decoded token) of the Executor, every sequence sampling
    with `sampler` (greedy by default; a list: one per sequence)."""
    pool = KvPool(model.config, w.batch * w.max_len, model.dtype, device)
    attention = make_backend(backend, model, decode_cache=decode_cache)
    executor = Executor(model, pool, attention=attention, constraints=constraints)
    plans = decode_plans(w)
    _check(executor.execute(prefill_plan(w, sampler)).error)
    _sync(device)
    started, cpu_started = time.perf_counter(), time.process_time()
    for plan in plans:
        _check(executor.execute(plan).error)
    _sync(device)
    tokens = w.batch * w.steps
    return tokens / (time.perf_counter() - started), (time.process_time() - cpu_started) / tokens


# The --logprobs comparison: (label, sampler), the first being the baseline of the CPU ratios.
LOGPROB_MODES = (
    ("none", SamplerParams()),
    ("logprobs", SamplerParams(logprobs=1)),
    ("top 20", SamplerParams(logprobs=21)),
)


def logprobs_table(model: LlamaModel, args: argparse.Namespace, device: torch.device) -> None:
    """Decode with and without logprobs, side by side (modes interleaved per repeat)."""
    names = " ".join(f"{name + ' tok/s':>15} {'us cpu/tok':>10}" for name, _ in LOGPROB_MODES)
    print(f"{'batch':>5} {names} {'cpu vs none':>16}")
    for batch in args.batches:
        w = make_workload(batch, args.prompt_len, args.steps, model.config.vocab_size)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in LOGPROB_MODES}
        for _ in range(args.repeats):
            for name, sampler in LOGPROB_MODES:
                runs[name].append(ours_decode_cost(model, w, device, sampler))
        # Best of the repeats: the highest tokens/s and the lowest CPU time per token.
        best = {name: (max(r[0] for r in rs), min(r[1] for r in rs)) for name, rs in runs.items()}
        cells = " ".join(f"{rate:>15.0f} {1e6 * cpu:>10.1f}" for rate, cpu in best.values())
        base = best["none"][1]
        ratios = "/".join(f"{best[name][1] / base:.2f}" for name, _ in LOGPROB_MODES[1:])
        print(f"{batch:>5} {cells} {ratios:>16}")


# The --constrained schema: no output finishes it within the timed steps.
BENCH_SCHEMA = '{"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64}'
CONSTRAINED_SHARES = (0.0, 0.5, 1.0)


def constrained_table(
    model: LlamaModel, model_dir: pathlib.Path, args: argparse.Namespace, device: torch.device
) -> None:
    """Decode with 0%, 50% and 100% of the batch constrained, side by side (interleaved per repeat)."""
    tokenizer_json = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    grammar = SamplerParams(grammar=Grammar(args.grammar_backend, "json_schema", BENCH_SCHEMA))
    names = " ".join(f"{f'{share:.0%} tok/s':>12} {'us cpu/tok':>10}" for share in CONSTRAINED_SHARES)
    print(f"{'batch':>5} {names} {'cpu vs 0%':>10}")
    for batch in args.batches:
        w = make_workload(batch, args.prompt_len, args.steps, model.config.vocab_size)
        runs: dict[float, list[tuple[float, float]]] = {share: [] for share in CONSTRAINED_SHARES}
        ours_decode_cost(model, w, device)  # warm-up (the first run of a batch size pays allocations)
        for _ in range(args.repeats):
            for share in CONSTRAINED_SHARES:
                held = round(share * batch)
                samplers = [grammar if i < held else SamplerParams() for i in range(batch)]
                constraints = Constraints(tokenizer_json, model.config.vocab_size, model.config.eos_token_ids)
                runs[share].append(ours_decode_cost(model, w, device, samplers, constraints=constraints))
        best = {share: (max(r[0] for r in rs), min(r[1] for r in rs)) for share, rs in runs.items()}
        cells = " ".join(f"{rate:>12.0f} {1e6 * cpu:>10.1f}" for rate, cpu in best.values())
        ratios = "/".join(f"{best[s][1] / best[0.0][1]:.2f}" for s in CONSTRAINED_SHARES[1:])
        print(f"{batch:>5} {cells} {ratios:>10}")


@torch.inference_mode()
def transformers_tokens_per_s(hf_model, w: Workload, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    """Decode tokens/s of transformers' forward with a DynamicCache on the same batch."""
    from transformers import DynamicCache

    cache = DynamicCache()
    # Only the last position's logits: all of them would be batch x prompt_len x vocab (GBs at 128k vocab).
    prompts = torch.from_numpy(w.prompts).to(device)
    out = hf_model(input_ids=prompts, cache=cache, use_cache=True, logits_to_keep=1)
    next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(device)
    started = time.perf_counter()
    for _ in range(w.steps):
        out = hf_model(input_ids=next_ids, cache=cache, use_cache=True)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(device)
    return w.batch * w.steps / (time.perf_counter() - started)


def _check(error: str) -> None:
    if error:
        raise RuntimeError(f"executor refused a bench plan: {error}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="embedded", help="checkpoint directory or 'embedded'")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timed runs each")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--logprobs", action="store_true", help="compare decode with and without logprobs (ours only)"
    )
    parser.add_argument(
        "--constrained",
        action="store_true",
        help="compare decode with 0%%, 50%% and 100%% of the batch held to a JSON schema (ours only)",
    )
    parser.add_argument(
        "--grammar-backend", default="llguidance", help="with --constrained: llguidance or xgrammar"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model_dir = resolve_model(args.model)
    ours = LlamaModel.from_dir(model_dir, device, dtype)
    if args.constrained:
        print(
            f"model {model_dir.name} on {device} {args.dtype}, torch threads {torch.get_num_threads()}, ",
            end="",
        )
        print(f"prompt {args.prompt_len} tokens, {args.steps} decode steps, best of {args.repeats}, ", end="")
        print(f"grammar backend {args.grammar_backend}")
        constrained_table(ours, model_dir, args, device)
        return
    if args.logprobs:
        print(
            f"model {model_dir.name} on {device} {args.dtype}, torch threads {torch.get_num_threads()}, ",
            end="",
        )
        print(f"prompt {args.prompt_len} tokens, {args.steps} decode steps, best of {args.repeats}")
        logprobs_table(ours, args, device)
        return
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    reference = reference.to(device).eval()  # type: ignore[arg-type]  # transformers' wrapped .to()
    print(
        f"model {model_dir.name} on {device} {args.dtype}, torch threads {torch.get_num_threads()}, ", end=""
    )
    print(f"prompt {args.prompt_len} tokens, {args.steps} decode steps, best of {args.repeats}")
    print(
        f"{'batch':>5} {'ours tok/s':>12} {'no decode cache':>16} {'transformers tok/s':>19}"
        f" {'ours/transformers':>18} {'step ms ours/no cache/transformers':>35}"
    )
    for batch in args.batches:
        w = make_workload(batch, args.prompt_len, args.steps, ours.config.vocab_size)
        mine = max(ours_tokens_per_s(ours, w, device) for _ in range(args.repeats))
        general = max(ours_tokens_per_s(ours, w, device, decode_cache=False) for _ in range(args.repeats))
        theirs = max(transformers_tokens_per_s(reference, w, device) for _ in range(args.repeats))
        step_ms = "/".join(f"{1000 * batch / rate:.2f}" for rate in (mine, general, theirs))
        rates = f"{mine:>12.0f} {general:>16.0f} {theirs:>19.0f}"
        print(f"{batch:>5} {rates} {mine / theirs:>18.2f} {step_ms:>35}")


if __name__ == "__main__":
    main()
