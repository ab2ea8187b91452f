"""`stepwise compare`: stepwise and its baselines on one workload, in the same run.

The workload (default: the issue's, 64 requests, prompts 16-128 tokens, outputs 8-256, greedy,
EOS ignored, 32 at a time) goes to every contender of `stepwise.baselines` once per round; rounds
interleave the contenders (round r runs each once, in turn), so a slow spell of the machine hits
them alike. Every process does its work on one thread: `torch.set_num_threads(1)` here,
`OMP_NUM_THREADS=1` for the Stack's children. Before the first round each contender serves a
short warm-up slice of the workload, untimed.

`--variant NAME="FLAGS"` (repeatable) adds, after the contenders, a stepwise contender named NAME
whose control plane runs with FLAGS (e.g. `--variant mixed-lpm="--enable-mixed-chunk
--schedule-policy lpm"`), on a Stack of its own; the contenders' defaults do not change.

Per contender it prints the useful output tokens per second (median over rounds), the ratio to
stepwise, the useful tokens per CPU second, and for the Stack contenders the worker's forward
steps next to `ideal_steps` of the workload.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from typing import Any, TextIO

from clients.datasets import BenchRequest, uniform_requests
from flagtypes import SEED, Int, IntPair
from flagtypes.table import SWITCH, Flag, Flags
from stepwise.baselines import CONTENDER_NAMES, Contender, Measurement, make_contenders

# Prompt and output lengths: at least one token, at most far past any context.
LENGTHS = IntPair(1, 1 << 20)
# Warm-up: this many requests of the workload, each cut to this many new tokens.
WARMUP_REQUESTS = 4
WARMUP_NEW_TOKENS = 4


def _names(text: str) -> tuple[str, ...]:
    """argparse type: a comma list of known contender names."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in CONTENDER_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: contenders are a comma list of {', '.join(CONTENDER_NAMES)}"
        )
    return names


def _variant(text: str) -> tuple[str, tuple[str, ...]]:
    """argparse type: `NAME=FLAGS`, FLAGS control-plane flags that `stepwise control` accepts."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or name in CONTENDER_NAMES:
        raise argparse.ArgumentTypeError(f'{text!r}: expected NAME="FLAGS", NAME not a contender\'s')
    try:
        flags = tuple(shlex.split(rest))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    problem = _control_flags_problem(flags)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return name, flags


def _control_flags_problem(flags: Sequence[str]) -> str | None:
    """Why the control plane would refuse `flags` (None: it takes them), without starting one."""
    from control_plane import config

    parser = argparse.ArgumentParser(exit_on_error=False, add_help=False)
    config.add_arguments(parser)
    try:
        ns, unknown = parser.parse_known_args(list(flags))
    except argparse.ArgumentError as e:
        return str(e)
    if unknown:
        return f"not control-plane flags: {' '.join(unknown)}"
    try:
        config.scheduler_config_from_args(ns, env={})
    except ValueError as e:
        return str(e)
    return None


class _VariantAction(argparse._AppendAction):
    """Append one variant; a name given twice is an error. (An append action, so that
    STEPWISE_VARIANT is read as one variant, as `stepwise.flags` does for repeatable options.)"""

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any, option: str | None = None
    ) -> None:
        variants = [*getattr(ns, self.dest), value]
        if value[0] in (name for name, _ in getattr(ns, self.dest)):
            raise argparse.ArgumentError(self, f"variant {value[0]!r} given twice")
        setattr(ns, self.dest, variants)


_FLAGS = Flags(
    None,
    (
        Flag("--requests", Int(1, 100_000), default=64, help="generations in the workload"),
        Flag("--prompt-len", LENGTHS, default=(16, 128), help="min,max prompt tokens (uniform, inclusive)"),
        Flag("--output-len", LENGTHS, default=(8, 256), help="min,max new tokens (uniform, inclusive)"),
        Flag(
            "--concurrency",
            Int(1, 100_000),
            default=32,
            help="requests in flight for the continuous batchers, and the batch size of the static ones",
        ),
        Flag("--rounds", Int(1, 1000), default=3, help="rounds; each runs every contender once"),
        Flag("--seed", SEED, default=0, help="seed of the workload's lengths and token ids"),
        Flag(
            "--contenders",
            _names,
            default=CONTENDER_NAMES,
            help=f"comma list of contenders, measured in this order (default: {','.join(CONTENDER_NAMES)})",
        ),
        Flag(
            "--variant",
            _variant,
            action=_VariantAction,
            dest="variants",
            default=[],
            metavar='NAME="FLAGS"',
            help="also measure stepwise with these control-plane flags, named NAME (repeatable)",
        ),
        Flag(
            "--model",
            default="embedded",
            help="the model every contender runs: a named model (stepwise models) or a checkpoint directory",
        ),
        Flag("--json", SWITCH, help="print the report as one JSON object"),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)


def ideal_steps(output_lens: Sequence[int], cap: int) -> int:
    """Forward steps of an ideal FCFS continuous batcher with at most `cap` requests running.

    Each step is one of two kinds. A prefill step, taken whenever a request waits and fewer than
    `cap` run: it admits, in arrival order, every waiting request that fits under the cap, runs
    all their prompts in one forward (no token budget, no chunking) and gives each its first
    output token. Otherwise a decode step: every running request gets one token. A request leaves
    as soon as it has its `max_new_tokens`. No step is ever idle, retracted or repeated, so this
    is the count a scheduler with SGLang's shape (prefill and decode in separate steps) reaches at
    best without delaying admissions.
    """
    waiting = deque(output_lens)
    running: list[int] = []  # tokens still to produce, per running request
    steps = 0
    while waiting or running:
        steps += 1
        room = cap - len(running)
        if waiting and room > 0:
            admitted = [waiting.popleft() - 1 for _ in range(min(room, len(waiting)))]
            running.extend(left for left in admitted if left > 0)
        else:
            running = [left - 1 for left in running if left > 1]
    return steps


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread in this process for the block."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


async def measure(
    contenders: Sequence[Contender], requests: Sequence[BenchRequest], cap: int, rounds: int
) -> dict[str, list[Measurement]]:
    """Start every contender, warm each up, then run `rounds` interleaved rounds; stop them all
    (also on failure). The measurements per contender name, in round order."""
    warmup = [replace(r, max_new_tokens=min(r.max_new_tokens, WARMUP_NEW_TOKENS)) for r in requests]
    warmup = warmup[:WARMUP_REQUESTS]
    results: dict[str, list[Measurement]] = {contender.name: [] for contender in contenders}
    try:
        for contender in contenders:
            await contender.start()
            await contender.run(warmup, cap)
        for _ in range(rounds):
            for contender in contenders:
                results[contender.name].append(await contender.run(requests, cap))
    finally:
        for contender in contenders:
            await contender.stop()
    return results


def summarize(
    results: dict[str, list[Measurement]], requests: Sequence[BenchRequest], ns: argparse.Namespace
) -> dict[str, Any]:
    """The report: the workload, its ideal step count, and per contender its medians over rounds
    (`vs_stepwise` is None when stepwise was not measured)."""
    wanted = sum(r.max_new_tokens for r in requests)
    rates = {name: statistics.median(_rates(runs, "wall_s")) for name, runs in results.items()}
    base = rates.get("stepwise")
    contenders = {}
    for name, runs in results.items():
        steps = [m.steps for m in runs if m.steps is not None]
        forward = [m.forward_tokens / max(m.wall_s, 1e-9) for m in runs if m.forward_tokens is not None]
        contenders[name] = {
            "tok_s": round(rates[name], 1),
            "forward_tok_s": round(statistics.median(forward), 1) if forward else None,
            "vs_stepwise": round(rates[name] / base, 3) if base else None,
            "tok_per_cpu_s": round(statistics.median(_rates(runs, "cpu_s")), 1),
            "useful_tokens": runs[0].useful_tokens,
            "steps": int(statistics.median(steps)) if steps else None,
            "rounds": [asdict(m) for m in runs],
        }
    return {
        "variants": {name: shlex.join(flags) for name, flags in getattr(ns, "variants", [])},
        "model": getattr(ns, "model", "embedded"),
        "workload": {
            "requests": len(requests),
            "prompt_len": list(ns.prompt_len),
            "output_len": list(ns.output_len),
            "concurrency": ns.concurrency,
            "rounds": ns.rounds,
            "seed": ns.seed,
            "useful_tokens": wanted,
        },
        "ideal_steps": ideal_steps([r.max_new_tokens for r in requests], ns.concurrency),
        "contenders": contenders,
        "vs_raw_loop": _vs_raw_loop(contenders),
    }


def _vs_raw_loop(contenders: dict[str, dict[str, Any]]) -> float | None:
    """Stepwise's useful tokens/s over the raw loop's forward tokens/s (every row it computes, the
    padding of its static batches included): how near serving comes to the bare batched forward."""
    stepwise, raw = contenders.get("stepwise"), contenders.get("raw-forward")
    if not stepwise or not raw or not raw["forward_tok_s"]:
        return None
    return round(stepwise["tok_s"] / raw["forward_tok_s"], 3)


def _rates(runs: Sequence[Measurement], seconds: str) -> list[float]:
    """Useful tokens per second of `seconds` ("wall_s" or "cpu_s"), per run."""
    return [m.useful_tokens / max(getattr(m, seconds), 1e-9) for m in runs]


def render(report: dict[str, Any]) -> str:
    """The report as a table, one row per contender."""
    work = report["workload"]
    lines = [
        f"model {report['model']}; workload: {work['requests']} requests, "
        f"prompts {work['prompt_len'][0]}-{work['prompt_len'][1]} "
        f"tokens, outputs {work['output_len'][0]}-{work['output_len'][1]} ({work['useful_tokens']} useful "
        f"tokens), {work['concurrency']} at a time, greedy, EOS ignored, one thread per process; "
        f"medians of {work['rounds']} rounds (seed {work['seed']})",
        f"{'contender':<20} {'tok/s':>9} {'vs stepwise':>12} {'tok/CPU-s':>10} {'tokens':>7}  "
        f"steps (ideal {report['ideal_steps']})",
    ]
    for name, row in report["contenders"].items():
        ratio = f"{row['vs_stepwise']:.2f}x" if row["vs_stepwise"] is not None else "-"
        steps = "-" if row["steps"] is None else str(row["steps"])
        lines.append(
            f"{name:<20} {row['tok_s']:>9.1f} {ratio:>12} {row['tok_per_cpu_s']:>10.1f} "
            f"{row['useful_tokens']:>7}  {steps}"
        )
    raw = report["contenders"].get("raw-forward")
    if raw and raw["forward_tok_s"]:
        rate = raw["forward_tok_s"]
        lines.append(f"raw-forward's batched loop computes {rate:.1f} tok/s, padding rows included")
    if report["vs_raw_loop"] is not None:
        lines.append(f"stepwise's useful tokens/s are {report['vs_raw_loop']:.2f}x of that")
    return "\n".join(lines)


async def run(ns: argparse.Namespace, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Build the workload, measure every contender, print the report (text or JSON) and return it."""
    from stepwise.models import resolve_model

    requests = uniform_requests(ns.requests, ns.prompt_len, ns.output_len, seed=ns.seed)
    contenders = make_contenders(ns.contenders, resolve_model(ns.model), ns.variants)
    with _one_thread():
        results = await measure(contenders, requests, ns.concurrency, ns.rounds)
    report = summarize(results, requests, ns)
    out.write((json.dumps(report) if ns.json else render(report)) + "\n")
    return report
