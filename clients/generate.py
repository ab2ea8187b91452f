"""`stepwise generate`: stream one generation to the terminal, then usage and timings."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from clients.client import (
    Generation,
    add_connection_arguments,
    apply_response,
    client_from_args,
    generate_request,
    sampling_params,
)
from flagtypes import UINT64_MAX, Float, Int, count
from flagtypes.table import SWITCH, Flag, Flags
from protos.stepwise.v1 import generation_pb2 as gen_pb


def _text_or_file(value: str) -> str:
    """A flag's text, or the contents of the file named after an @."""
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {value[1:]}: {exc.strerror}") from None


# --max-new-tokens, --temperature, --top-p, --top-k and --seed, in the ranges the server takes.
SAMPLING_FLAGS = Flags(
    None,
    (
        Flag("--max-new-tokens", count(0), default=64, help="stop after this many new tokens"),
        Flag("--temperature", Float(0.0, 100.0), default=0.0, help="0: greedy"),
        Flag("--top-p", Float(1e-6, 1.0), help="nucleus sampling mass (default: 1.0)"),
        Flag("--top-k", count(0), help="sample among the k likeliest (default or 0: no limit)"),
        Flag("--seed", Int(0, UINT64_MAX), help="sampling seed (default: the server's)"),
        Flag("--stop", action="append", default=[], help="stop string (repeatable)"),
        Flag("--ignore-eos", SWITCH, help="keep generating past end-of-sequence"),
    ),
)
_LOGPROBS = Flags(
    None,
    (
        Flag(
            "--top-logprobs",
            count(0),
            help="after the text, each token's log probability and this many likeliest alternatives "
            "(0: the token's own only; at most the server's --max-top-logprobs)",
        ),
    ),
)
# One constraint at most (a mutually exclusive group).
_HELD = Flags(
    None,
    (
        Flag(
            "--json-schema",
            _text_or_file,
            help="hold the output to this JSON Schema (JSON text, or @FILE to read it from a file)",
        ),
        Flag("--regex", help="hold the output to a whole match of this regex"),
        Flag("--ebnf", _text_or_file, help="hold the output to this GBNF grammar (text or @FILE)"),
        Flag("--choice", action="append", help="the output is exactly one of these (repeatable)"),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    Flags(None, (Flag("prompt", help="prompt text"),)).add_to(parser)
    add_connection_arguments(parser)
    add_sampling_arguments(parser)
    _LOGPROBS.add_to(parser)
    _HELD.add_to(parser.add_mutually_exclusive_group())


def add_sampling_arguments(parser: argparse.ArgumentParser, max_new_tokens: int = 64) -> None:
    """SAMPLING_FLAGS, with the command's own --max-new-tokens default."""
    SAMPLING_FLAGS.replace("--max-new-tokens", default=max_new_tokens).add_to(parser)


def sampling_from_args(ns: argparse.Namespace) -> gen_pb.SamplingParams:
    """SamplingParams from add_sampling_arguments' flags, every one of them."""
    return sampling_params(
        max_new_tokens=ns.max_new_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )


async def run(ns: argparse.Namespace, out: TextIO = sys.stdout, echo: str | None = None) -> Generation:
    """Stream `ns.prompt`'s generation to `out`, after `echo` (default: the prompt itself)."""
    sampling = sampling_from_args(ns)
    constraint = sampling_params(
        json_schema=getattr(ns, "json_schema", None),
        regex=getattr(ns, "regex", None),
        ebnf=getattr(ns, "ebnf", None),
        choice=getattr(ns, "choice", None),
    )
    sampling.MergeFrom(constraint)
    top = getattr(ns, "top_logprobs", None)
    if top is not None:
        sampling.logprobs, sampling.top_logprobs = True, top
    gen = Generation()
    echoed = False
    async with client_from_args(ns) as client:
        await client.wait_ready(ns.wait)
        # The prompt is echoed with the first answer, so a refused call leaves stdout empty.
        async for response in client.stream(generate_request(ns.prompt, sampling)):
            if not echoed:
                out.write(ns.prompt if echo is None else echo)
                echoed = True
            apply_response(gen, response)
            if response.WhichOneof("event") == "chunk":
                out.write(response.chunk.text)
                out.flush()
    out.write("\n")
    if top is not None:
        out.write(logprob_table(gen))
    out.write(summary(gen) + "\n")
    out.flush()
    return gen


def logprob_table(gen: Generation) -> str:
    """One line per generated token: its text, log probability and the alternatives asked for."""
    lines = []
    for score in gen.logprobs:
        alternatives = "  ".join(
            f"{t!r} {lp:.3f}" for t, lp in zip(score.top_tokens, score.top_logprobs, strict=False)
        )
        lines.append(
            f"{score.token!r:>16} {score.logprob:9.4f}" + (f"   | {alternatives}" if alternatives else "")
        )
    return "".join(line + "\n" for line in lines)


def summary(gen: Generation) -> str:
    tps = gen.completion_tokens / gen.total_s if gen.total_s > 0 else 0.0
    reason = gen.finish_reason + (f" ({gen.finish_message})" if gen.finish_message else "")
    return (
        f"[finish: {reason} | prompt {gen.prompt_tokens} tokens, cached {gen.cached_tokens}, "
        f"completion {gen.completion_tokens} | queue {gen.queue_s * 1000:.1f} ms, "
        f"ttft {gen.ttft_s * 1000:.1f} ms, total {gen.total_s * 1000:.1f} ms, {tps:.1f} tok/s]"
    )
