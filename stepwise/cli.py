"""The `stepwise` command: one console script, a subcommand per role.

Imports stay inside the subcommands: the control plane never loads torch, and `generate` loads
neither plane.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from stepwise import flags, logs

DEMO_PROMPT = "Once upon a time"


def _control_parser() -> argparse.ArgumentParser:
    from control_plane import config

    parser = argparse.ArgumentParser(prog="stepwise control", description="the control plane")
    config.add_arguments(parser)
    parser.add_argument("--ready-file", type=Path, default=None, help="write the bound ports here as JSON")
    parser.add_argument("--log-level", default="info")
    flags.apply_env_defaults(parser)
    return parser


def _worker_parser() -> argparse.ArgumentParser:
    from data_plane import config

    parser = argparse.ArgumentParser(prog="stepwise worker", description="a data-plane worker")
    config.add_arguments(parser)
    parser.add_argument("--log-level", default="info")
    for action in parser._actions:
        if action.dest == "model":
            action.required, action.default, action.type = False, "embedded", str
    flags.apply_env_defaults(parser)
    return parser


def cmd_control(argv: Sequence[str]) -> int:
    from control_plane.config import control_config_from_args
    from stepwise.embedded import resolve_model

    ns = _control_parser().parse_args(argv)
    logs.configure(ns.log_level)
    try:
        config = control_config_from_args(ns, resolve_model(ns.model))
    except ValueError as exc:
        print(f"stepwise control: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve_control(config, ns.ready_file))


async def _serve_control(config: object, ready_file: Path | None) -> int:
    from control_plane.server import ControlPlane

    plane = ControlPlane(config)  # type: ignore[arg-type]
    await plane.start()
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": plane.port, "worker_port": plane.worker_port}))
        tmp.rename(ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await plane.stop()
    return 0


def cmd_worker(argv: Sequence[str]) -> int:
    from data_plane import config, worker
    from stepwise.embedded import resolve_model

    ns = _worker_parser().parse_args(argv)
    logs.configure(ns.log_level)
    ns.model = resolve_model(ns.model)
    try:
        cfg = config.config_from_args(ns)
    except ValueError as exc:
        print(f"stepwise worker: {exc}", file=sys.stderr)
        return 2
    return worker.run(cfg)


def _up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepwise up",
        description="a control plane and N workers as child processes; every other flag is passed on",
    )
    parser.add_argument("--workers", type=int, default=1)
    flags.apply_env_defaults(parser)
    return parser


def cmd_up(argv: Sequence[str]) -> int:
    from stepwise.up import Stack, run_up, split_flags

    ns, rest = _up_parser().parse_known_args(argv)
    to_control, to_worker = split_flags(rest, _control_parser(), _worker_parser())
    return asyncio.run(run_up(Stack(to_control, to_worker, ns.workers)))


def cmd_generate(argv: Sequence[str]) -> int:
    from clients import generate

    parser = argparse.ArgumentParser(prog="stepwise generate", description="stream one generation")
    generate.add_arguments(parser)
    flags.apply_env_defaults(parser)
    ns = parser.parse_args(argv)
    gen = asyncio.run(generate.run(ns))
    return 0 if gen.finish_reason in ("stop", "length") else 1


def cmd_bench(argv: Sequence[str]) -> int:
    from clients import bench

    parser = argparse.ArgumentParser(prog="stepwise bench", description="load generator with serving metrics")
    bench.add_arguments(parser)
    flags.apply_env_defaults(parser)
    report = asyncio.run(bench.run(parser.parse_args(argv)))
    return 0 if report["completed"] == report["requests"] else 1


def cmd_demo(argv: Sequence[str]) -> int:
    """Start the stack on the embedded model, stream one generation, stop everything."""
    from clients import generate
    from stepwise.up import Stack

    parser = argparse.ArgumentParser(prog="stepwise demo")
    parser.add_argument("prompt", nargs="?", default=DEMO_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=80)
    ns = parser.parse_args(argv)

    async def demo() -> int:
        stack = Stack(
            ["--port", "0", "--worker-port", "0", "--host", "127.0.0.1", "--log-level", "warning"],
            ["--log-level", "warning"],
            workers=1,
        )
        try:
            address = await stack.start()
            print(f"[stepwise: control plane and one worker up at {address}]", flush=True)
            gen_ns = argparse.Namespace(
                prompt=ns.prompt,
                address=address,
                max_new_tokens=ns.max_new_tokens,
                temperature=0.0,
                top_p=None,
                top_k=None,
                seed=None,
                stop=[],
                ignore_eos=False,
                wait=60.0,
            )
            gen = await generate.run(gen_ns)
            return 0 if gen.finish_reason in ("stop", "length") else 1
        finally:
            stack.stop()

    return asyncio.run(demo())


def cmd_replay(argv: Sequence[str]) -> int:
    from stepwise import replay

    return replay.main(argv)


def cmd_simulate(argv: Sequence[str]) -> int:
    from stepwise import simulate

    return simulate.main(argv)


COMMANDS = {
    "control": cmd_control,
    "worker": cmd_worker,
    "up": cmd_up,
    "generate": cmd_generate,
    "bench": cmd_bench,
    "demo": cmd_demo,
    "replay": cmd_replay,
    "simulate": cmd_simulate,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        names = ", ".join(COMMANDS)
        print(
            f"usage: stepwise {{{names}}} [flags]   (stepwise COMMAND --help for its flags)", file=sys.stderr
        )
        return 0 if args and args[0] in ("-h", "--help") else 2
    from stepwise.parent import die_with_parent

    die_with_parent()
    with contextlib.suppress(KeyboardInterrupt):
        return COMMANDS[args[0]](args[1:])
    return 130


if __name__ == "__main__":
    sys.exit(main())
