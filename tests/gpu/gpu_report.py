"""One report of the worker on a GPU: greedy equality, decode tokens/s and the HBM roofline.

    python tests/gpu/gpu_report.py [--batches 1 64 256] [--prompt-len 128] [--steps 64]
                                   [--peak-gbps GBPS] [--json FILE] [--shape llama-3.2-1b|tiny]
                                   [--device cuda] [--dtype bfloat16]

The checkpoint is built on the spot: random weights (fixed seed) in a transformers LlamaForCausalLM
shaped like Llama-3.2-1B (or a tiny one, `--shape tiny`, that runs on a CPU in seconds), saved
with save_pretrained and loaded by our loader; the in-memory transformers model is the reference.

Greedy: a few prompts prefilled and decoded together by our Executor against transformers'
generate(do_sample=False), allowing a split only at a near-tie (tests/gpu/greedy.py). Decode:
bench/bench_worker.py's loops for ours and for transformers' DynamicCache, after a short warm-up.
Roofline: a decode step must read every weight once plus the K/V of every context token, so
bytes / peak bandwidth is the fastest that step can be; the fraction is that over the measured step.
Exit status 1 when greedy equality fails.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from bench.bench_worker import make_workload, ours_tokens_per_s, transformers_tokens_per_s
from data_plane.backends import make_backend
from data_plane.config import BACKENDS
from data_plane.executor import Executor
from data_plane.kv_pool import KvPool, bytes_per_token
from data_plane.models.llama import LlamaModel
from tests.data_plane.factories import Driver, SlotAllocator
from tests.gpu.greedy import LOGITS_TOLERANCE, GreedyComparison, compare_greedy

# LlamaConfig settings per --shape. No bos/eos, so generate never stops early. Plain rope at
# Llama 3's theta: its llama3 scaling needs max_position_embeddings above 8192, and the worker's
# sequence table holds max_position_embeddings slots per row.
_COMMON: dict[str, Any] = dict(
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        _COMMON,
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        initializer_range=0.02,
    ),
    "tiny": dict(
        _COMMON,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # At 0.02 a hidden size of 64 leaves the layers' updates no bigger than the token's own
        # embedding, and with tied embeddings greedy then just repeats the last prompt token.
        initializer_range=0.2,
    ),
}
GREEDY_PROMPT_LENS = (8, 17, 29, 40)

# Peak HBM bandwidth in GB/s by the tokens of torch.cuda.get_device_name(); every token must appear
# (whole tokens, so "A10" does not match an A100 nor "L4" an L40S).
PEAK_GBPS: tuple[tuple[frozenset[str], float], ...] = (
    (frozenset({"H200"}), 4800.0),
    (frozenset({"H100", "HBM3"}), 3350.0),  # SXM: "NVIDIA H100 80GB HBM3"
    (frozenset({"H100", "SXM5"}), 3350.0),
    (frozenset({"H100", "PCIE"}), 2000.0),
    (frozenset({"A100", "80GB"}), 2039.0),
    (frozenset({"A100", "40GB"}), 1555.0),
    (frozenset({"L4"}), 300.0),
    (frozenset({"A10"}), 600.0),
    (frozenset({"RTX", "4090"}), 1008.0),
)


@dataclass(frozen=True, slots=True)
class DecodeFigures:
    """One batch size: both sides' decode rate and how close each comes to the HBM roofline."""

    batch: int
    ours_tokens_per_s: float
    transformers_tokens_per_s: float
    bytes_per_step: int
    roofline_ms: float | None  # None when the peak bandwidth is unknown
    ours_step_ms: float
    transformers_step_ms: float
    ours_roofline_fraction: float | None
    transformers_roofline_fraction: float | None


@dataclass(frozen=True, slots=True)
class Report:
    device: str
    torch_version: str
    transformers_version: str
    dtype: str
    attention_backend: str
    shape: str
    config: dict[str, Any]
    parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    peak_gbps: float | None
    peak_source: str  # "--peak-gbps", "table" or "unknown"
    new_tokens: int
    greedy: list[GreedyComparison]
    prompt_len: int
    steps: int
    warmup_steps: int
    decode: list[DecodeFigures]

    @property
    def greedy_ok(self) -> bool:
        return all(c.ok for c in self.greedy)

    def to_json(self) -> dict[str, Any]:
        """Every figure, the greedy rows with their verdicts (properties are not in asdict)."""
        out = asdict(self)
        out["greedy"] = [dict(asdict(c), equal=c.equal, ok=c.ok) for c in self.greedy]
        out["greedy_ok"] = self.greedy_ok
        return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    parser.add_argument("--warmup-steps", type=int, default=4, help="untimed decode steps first")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared per prompt")
    parser.add_argument("--peak-gbps", type=float, default=None, help="HBM GB/s (default: by device)")
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=BACKENDS,
        help="the worker's attention backend (auto: flashinfer on CUDA when installed, else sdpa)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the figures here")
    return parser.parse_args(argv)


def resolve_device(name: str) -> torch.device:
    """An explicit index for CUDA, so our tensors and transformers' compare equal as devices."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def peak_bandwidth(name: str, flag: float | None) -> tuple[float | None, str]:
    """GB/s and where it came from: the flag wins, else the table, else unknown."""
    if flag is not None:
        return flag, "--peak-gbps"
    tokens = set(re.split(r"[^A-Z0-9]+", name.upper()))
    for needed, gbps in PEAK_GBPS:
        if needed <= tokens:
            return gbps, "table"
    return None, "unknown"


def build_reference(
    shape: str, out: pathlib.Path, device: torch.device, dtype: torch.dtype, seed: int
) -> Any:
    """A random LlamaForCausalLM made directly on `device` in `dtype`, saved to `out` as safetensors.

    Creating it under the device context runs transformers' normal_ init there: seconds on
    a GPU for 1.2B parameters, where a CPU init then copy would take minutes.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[shape]), dtype=dtype)
    model.eval()
    model.save_pretrained(str(out))
    return model


def decode_cache_on(device: torch.device) -> bool:
    """The decode cache only on a CPU, as data_plane/worker.py runs it: the report times the worker."""
    return device.type == "cpu"


def make_executor(model: LlamaModel, capacity: int, backend: str) -> Executor:
    pool = KvPool(model.config, capacity, model.dtype, model.device)
    attention = make_backend(backend, model, decode_cache=decode_cache_on(model.device))
    return Executor(model, pool, attention=attention)


def greedy_prompts(vocab: int, seed: int) -> dict[int, list[int]]:
    rng = np.random.default_rng(seed)
    return {h: rng.integers(0, vocab, size=n).tolist() for h, n in enumerate(GREEDY_PROMPT_LENS, start=1)}


def check_greedy(
    ours: LlamaModel, reference: Any, new_tokens: int, seed: int, backend: str
) -> list[GreedyComparison]:
    """Every greedy prompt in one batch on scrambled pages of 16 slots, against generate()."""
    driver = Driver(make_executor(ours, 1024, backend), SlotAllocator(1024, 16, seed=seed))
    return compare_greedy(driver, reference, greedy_prompts(ours.config.vocab_size, seed), new_tokens)


def measure_decode(
    ours: LlamaModel,
    reference: Any,
    batch: int,
    args: argparse.Namespace,
    weight_bytes: int,
    peak_gbps: float | None,
) -> DecodeFigures:
    """Both decode loops at one batch size, each after an untimed warm-up at the same shapes."""
    device, vocab = ours.device, ours.config.vocab_size
    decode_cache = decode_cache_on(device)
    warmup = make_workload(batch, args.prompt_len, args.warmup_steps, vocab, seed=args.seed)
    timed = make_workload(batch, args.prompt_len, args.steps, vocab, seed=args.seed)
    backend = args.attention_backend
    ours_tokens_per_s(ours, warmup, device, decode_cache, backend)
    mine = ours_tokens_per_s(ours, timed, device, decode_cache, backend)
    transformers_tokens_per_s(reference, warmup, device)
    theirs = transformers_tokens_per_s(reference, timed, device)
    # Decode step i attends over prompt_len + i + 1 positions; the mean over the timed steps:
    mean_context = args.prompt_len + (args.steps + 1) / 2
    kv_bytes = bytes_per_token(ours.config, ours.dtype) * batch * mean_context
    step_bytes = int(weight_bytes + kv_bytes)
    roofline_ms = None if peak_gbps is None else 1000 * step_bytes / (peak_gbps * 1e9)
    ours_ms, theirs_ms = 1000 * batch / mine, 1000 * batch / theirs
    return DecodeFigures(
        batch=batch,
        ours_tokens_per_s=mine,
        transformers_tokens_per_s=theirs,
        bytes_per_step=step_bytes,
        roofline_ms=roofline_ms,
        ours_step_ms=ours_ms,
        transformers_step_ms=theirs_ms,
        ours_roofline_fraction=None if roofline_ms is None else roofline_ms / ours_ms,
        transformers_roofline_fraction=None if roofline_ms is None else roofline_ms / theirs_ms,
    )


def run(args: argparse.Namespace) -> Report:
    """Build, load, compare and time; everything the report prints."""
    import transformers

    device, dtype = resolve_device(args.device), getattr(torch, args.dtype)
    name = device_name(device)
    peak_gbps, peak_source = peak_bandwidth(name, args.peak_gbps)
    with tempfile.TemporaryDirectory(prefix="stepwise-gpu-report-") as tmp:
        reference = build_reference(args.shape, pathlib.Path(tmp), device, dtype, args.seed)
        ours = LlamaModel.from_dir(pathlib.Path(tmp), device, dtype)
    # parameters() lists a tied tensor once: the embedding is read once per step, as lm_head.
    params = list(reference.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    backend = make_backend(args.attention_backend, ours).name
    greedy = check_greedy(ours, reference, args.new_tokens, args.seed, backend)
    decode = [measure_decode(ours, reference, b, args, weight_bytes, peak_gbps) for b in args.batches]
    return Report(
        device=name,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        dtype=args.dtype,
        attention_backend=backend,
        shape=args.shape,
        config=SHAPES[args.shape],
        parameters=sum(p.numel() for p in params),
        weight_bytes=weight_bytes,
        kv_bytes_per_token=bytes_per_token(ours.config, dtype),
        peak_gbps=peak_gbps,
        peak_source=peak_source,
        new_tokens=args.new_tokens,
        greedy=greedy,
        prompt_len=args.prompt_len,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        decode=decode,
    )


def _fraction(value: float | None) -> str:
    return "unknown" if value is None else f"{100 * value:.3g}%"


def _greedy_line(c: GreedyComparison) -> str:
    head = f"  prompt {c.prompt_len:>3} tokens: "
    if c.equal:
        return head + "equal"
    verdict = "near-tie, allowed" if c.ok else "MISMATCH"
    return head + f"first divergence at new token {c.first_divergence}, logit gap {c.tie_gap:.4f} ({verdict})"


def format_report(r: Report) -> str:
    """The human-readable report: setup, greedy verdicts, then one decode row per batch size."""
    cfg = r.config
    peak = "unknown" if r.peak_gbps is None else f"{r.peak_gbps:.0f} GB/s ({r.peak_source})"
    lines = [
        "Stepwise GPU report",
        f"device        {r.device}",
        f"torch         {r.torch_version}, transformers {r.transformers_version}",
        f"dtype         {r.dtype}",
        f"attention     {r.attention_backend}",
        f"shape         {r.shape}: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} heads, {cfg['num_key_value_heads']} kv heads, "
        f"intermediate {cfg['intermediate_size']}, vocab {cfg['vocab_size']}",
        f"weights       {r.parameters:,} parameters, {r.weight_bytes / 1e6:,.1f} MB",
        f"KV            {r.kv_bytes_per_token:,} bytes per token",
        f"peak HBM      {peak}",
        "",
        f"greedy vs transformers generate ({r.new_tokens} new tokens, near-tie gap < {LOGITS_TOLERANCE}):",
        *(_greedy_line(c) for c in r.greedy),
        f"greedy        {'PASS' if r.greedy_ok else 'FAIL'}",
        "",
        f"decode: prompt {r.prompt_len} tokens, {r.steps} timed steps after {r.warmup_steps} warm-up steps",
        f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>11} {'ours/hf':>8} {'ours ms':>9} {'hf ms':>9}"
        f" {'MB/step':>9} {'roof ms':>9} {'ours roof':>10} {'hf roof':>10}",
    ]
    for d in r.decode:
        roof = "unknown" if d.roofline_ms is None else f"{d.roofline_ms:.3f}"
        lines.append(
            f"{d.batch:>5} {d.ours_tokens_per_s:>11.1f} {d.transformers_tokens_per_s:>11.1f}"
            f" {d.ours_tokens_per_s / d.transformers_tokens_per_s:>8.2f} {d.ours_step_ms:>9.3f}"
            f" {d.transformers_step_ms:>9.3f} {d.bytes_per_step / 1e6:>9.2f} {roof:>9}"
            f" {_fraction(d.ours_roofline_fraction):>10} {_fraction(d.transformers_roofline_fraction):>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging

    logging.disable_progress_bar()  # save_pretrained's shard bar, on every run
    args = parse_args(argv)
    report = run(args)
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0 if report.greedy_ok else 1


if __name__ == "__main__":
    sys.exit(main())
