"""The `stepwise` command: one console script, a subcommand per role.

Imports stay inside the subcommands: the control plane never loads torch, and `generate` loads
neither plane.

Routine failures (a bad flag or environment value, a missing model directory, a busy port, no
server at the address, a call the control plane refused) print one line, `stepwise CMD: what`,
and exit 2; `main()` maps them in one place. Anything else is a bug and keeps its traceback.
A closed stdout (`stepwise replay show REC | head -1`) ends any command quietly with 141, as SIGPIPE
ends `cat` (EXIT_READER_LEFT).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from clients.errors import RoutineError
from flagtypes import INT32_MAX, Int
from flagtypes.table import Flag, Flags
from stepwise import flags, logs

if TYPE_CHECKING:
    from control_plane.config import ControlConfig
    from control_plane.core.server import ControlPlane
    from gateway.app import GatewayConfig
    from gateway.chat import ChatTemplate

DEMO_PROMPT = "Once upon a time"
# The exit status when stdout's reader went away: a shell's for a process ended by SIGPIPE.
EXIT_READER_LEFT = 128 + signal.SIGPIPE
# gRPC status codes that mean the control plane answered and said no: the caller's to fix.
REFUSED_CODES = frozenset(
    {
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
        "OUT_OF_RANGE",
        "ALREADY_EXISTS",
    }
)


def _parser(prog: str, description: str, allow_abbrev: bool = True) -> flags.ArgumentParser:
    return flags.ArgumentParser(prog=prog, description=description, allow_abbrev=allow_abbrev)


def _log_level(text: str) -> str:
    """argparse type: a level of logs.LEVELS, in any case."""
    if text.lower() not in logs.LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(logs.LEVELS)}, got {text!r}")
    return text.lower()


_LOG_LEVEL = Flags(
    None,
    (
        Flag(
            "--log-level",
            _log_level,
            default="info",
            help=f"the least severe lines logged: {', '.join(logs.LEVELS)} (any case)",
        ),
    ),
)


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    _LOG_LEVEL.add_to(parser)


def _control_parser() -> argparse.ArgumentParser:
    from control_plane import config

    parser = _parser("stepwise control", COMMANDS["control"].summary)
    config.add_arguments(parser)
    Flags(None, (Flag("--ready-file", Path, help="write the bound ports here as JSON"),)).add_to(parser)
    _add_log_level(parser)
    flags.apply_env_defaults(parser)
    return parser


def _worker_parser() -> argparse.ArgumentParser:
    from data_plane import config

    parser = _parser("stepwise worker", COMMANDS["worker"].summary)
    # The command resolves --model itself (a named model, the embedded one by default).
    config.FLAGS.replace("--model", type=str, default="embedded", required=False).add_to(parser)
    _add_log_level(parser)
    flags.apply_env_defaults(parser)
    return parser


def _resolve_model(spec: str | Path) -> Path:
    """resolve_model(), with a missing or incomplete directory as a RoutineError naming --model."""
    from stepwise.models import ModelError, resolve_model

    try:
        return resolve_model(str(spec))
    except (FileNotFoundError, ModelError) as exc:
        raise RoutineError(f"--model: {exc}") from exc


def cmd_control(argv: Sequence[str]) -> int:
    from control_plane.config import control_config_from_args

    ns = _control_parser().parse_args(argv)
    logs.configure(ns.log_level)
    model_dir = _resolve_model(ns.model)
    from stepwise.models import served_name

    try:
        name = ns.served_model_name or served_name(ns.model, model_dir)
        config = control_config_from_args(ns, model_dir, name)
    except ValueError as exc:
        raise RoutineError(str(exc)) from exc
    with _metrics_dir(config.metrics_port):
        return asyncio.run(_serve_control(config, ns.ready_file, ns.log_level))


@contextlib.contextmanager
def _metrics_dir(port: int) -> Iterator[None]:
    """With --metrics-port, the core and its frontends keep their metrics in files of one directory
    (prometheus_client's multiprocess mode) and the core serves their sum. The variable must be set
    before prometheus_client is first imported, in this process and so in the frontends it spawns."""
    if not port:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="stepwise-metrics-") as directory:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
        try:
            yield
        finally:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


async def _serve_control(config: ControlConfig, ready_file: Path | None, log_level: str) -> int:
    from control_plane.core.server import ControlPlane
    from control_plane.core.supervisor import FrontendStartError
    from stepwise import frontend

    if config.record_dir is not None:
        from control_plane.record.files import RecordingError, check_writable

        try:
            check_writable(config.record_dir)
        except RecordingError as exc:
            raise RoutineError(f"--record {config.record_dir}: {exc}") from None
    plane = ControlPlane(config, log_level, frontend.main)
    try:
        await plane.start()
    except (OSError, FrontendStartError) as exc:  # a busy or unbindable port, a frontend that died
        await plane.stop(grace=0)
        raise RoutineError(f"cannot start: {exc}") from exc
    if ready_file is not None:
        ready = {
            "port": plane.port,
            "worker_port": plane.worker_port,
            "pid": os.getpid(),
            "frontend_pids": plane.frontends.pids(),
        }
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(ready))
        tmp.rename(ready_file)
    await _until_stopped(plane)
    await plane.stop()
    return 0


async def _until_stopped(plane: ControlPlane) -> None:
    """Return when the control plane should stop: after a drain on SIGTERM (as Kubernetes stops a
    pod), at once on SIGINT or on a second signal during the drain."""
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    # SIGHUP rereads the tenant file (docs/deploy.md#tenants); it never stops the control plane.
    loop.add_signal_handler(signal.SIGHUP, plane.reload_tenants)
    if await signals.get() != signal.SIGTERM:
        return
    drain = asyncio.create_task(plane.drain())
    again = asyncio.create_task(signals.get())
    await asyncio.wait({drain, again}, return_when=asyncio.FIRST_COMPLETED)
    again.cancel()
    if not drain.done():
        print("stepwise control: a second signal: stopping without waiting for the drain", file=sys.stderr)
        drain.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await drain


def cmd_worker(argv: Sequence[str]) -> int:
    from data_plane import config, worker

    ns = _worker_parser().parse_args(argv)
    logs.configure(ns.log_level)
    ns.model = _resolve_model(ns.model)
    try:
        cfg = config.config_from_args(ns)
    except ValueError as exc:
        raise RoutineError(str(exc)) from exc
    return worker.run(cfg)


def _up_parser() -> argparse.ArgumentParser:
    from stepwise.up import UP_FLAGS, passed_on_sections

    # No abbreviations: the flags up passes on are not its own, and `--control` (a worker's) would
    # otherwise be taken for `--control-planes`.
    parser = _parser(
        "stepwise up",
        COMMANDS["up"].summary + "; every other flag goes to the child that knows it, as listed below",
        allow_abbrev=False,
    )
    UP_FLAGS.add_to(parser)
    from gateway.server import add_template_arguments

    add_template_arguments(parser)  # the gateway's, passed on to it
    Flags(
        None, (Flag("--ready-file", Path, help="write the client and gateway addresses here as JSON"),)
    ).add_to(parser)
    # Built from the children's own parsers when --help asks, so the list cannot drift from them.
    parser.help_sections = lambda: passed_on_sections(
        parser, _control_parser(), _worker_parser(), _gateway_parser()
    )
    flags.apply_env_defaults(parser)
    return parser


def cmd_up(argv: Sequence[str]) -> int:
    from stepwise.models import served_names
    from stepwise.up import Stack, gateway_args, run_up, split_flags

    ns, rest = _up_parser().parse_known_args(argv)
    control, worker = _control_parser(), _worker_parser()
    try:
        to_control, to_worker = split_flags(rest, control, worker)
    except ValueError as exc:
        raise RoutineError(str(exc)) from exc
    given = any(arg.split("=", 1)[0] == "--served-model-name" for arg in to_control)
    if ns.gateway_served_model_name and not given:
        # GetServerInfo reports the name the gateway reports.
        names = served_names(ns.gateway_served_model_name)
        to_control += ["--served-model-name", names[0]]
    # Bad values are the children's to reject, but here they are one line instead of a child's
    # line and then `up`'s own complaint that the child exited.
    control_ns, worker_ns = control.parse_args(to_control), worker.parse_args(to_worker)
    # A named model is built or converted here, once, before the children start and look for it.
    for spec in dict.fromkeys([control_ns.model, worker_ns.model]):
        _resolve_model(spec)
    gateway = None
    template_flags = _gateway_template_flags(ns)
    if ns.gateway_port is not None:
        gateway = (
            gateway_args(
                to_control, ns.gateway_host, ns.gateway_port, ns.gateway_served_model_name, ns.gateway_workers
            )
            + template_flags
        )
    stack = Stack(to_control, to_worker, ns.workers, gateway, control_planes=ns.control_planes)
    return asyncio.run(run_up(stack, ns.ready_file))


def _gateway_template_flags(ns: argparse.Namespace) -> list[str]:
    """`up`'s --chat-template and --tool-call-parser, as the gateway's flags; refused without
    --gateway-port (there is no gateway to take them)."""
    flags = [
        *(["--chat-template", ns.chat_template] if ns.chat_template is not None else []),
        *(["--tool-call-parser", ns.tool_call_parser] if ns.tool_call_parser is not None else []),
    ]
    if flags and ns.gateway_port is None:
        raise RoutineError(f"{flags[0]}: the gateway's, and it starts only with --gateway-port")
    return flags


def _gateway_parser() -> argparse.ArgumentParser:
    from gateway import server

    parser = _parser("stepwise gateway", COMMANDS["gateway"].summary)
    server.add_arguments(parser)
    _add_log_level(parser)
    flags.apply_env_defaults(parser)
    return parser


def cmd_gateway(argv: Sequence[str]) -> int:
    _quiet_grpc()
    from gateway import server
    from gateway.app import GatewayConfig
    from gateway.tools import parser_name

    ns = _gateway_parser().parse_args(argv)
    logs.configure(ns.log_level)
    model_dir = _resolve_model(ns.model)
    template = _chat_template(ns, model_dir)
    from control_plane.tokenizer import Tokenizer
    from stepwise.models import served_name, served_names

    names = served_names(ns.served_model_name) or [served_name(ns.model, model_dir)]
    try:
        tokenizer = Tokenizer.from_dir(model_dir)
    except FileNotFoundError:
        tokenizer = None  # /tokenize, /detokenize and what needs token ids answer 501
    except Exception as exc:  # a tokenizer.json the tokenizers library cannot read
        raise RoutineError(f"--model: cannot load the tokenizer of {model_dir}: {exc}") from exc
    try:
        limits = server.limits_from_args(ns)
    except ValueError as exc:
        raise RoutineError(str(exc)) from exc
    parser = None if ns.tool_call_parser is None else parser_name(ns.tool_call_parser)
    config = GatewayConfig(
        ns.control, names[0], template, ns.tls_ca, limits, tokenizer, parser, tuple(names[1:])
    )
    if ns.workers > 1:
        return _gateway_workers(config, ns)
    try:
        sock = server.bind(ns.host, ns.port)
    except OSError as exc:
        raise RoutineError(str(exc)) from exc
    return asyncio.run(server.serve(config, sock, ns.log_level, ns.ready_file))


def _chat_template(ns: argparse.Namespace, model_dir: Path) -> ChatTemplate | None:
    """--chat-template's template, else the model's (stepwise.models.chat_template); one line for a
    template that cannot be read."""
    from stepwise.models import chat_template

    try:
        return chat_template(ns.model, model_dir, ns.chat_template)
    except ValueError as exc:
        if ns.chat_template is not None:
            raise RoutineError(f"--chat-template: {exc}") from exc
        raise RoutineError(f"--model: cannot read the chat template of {model_dir}: {exc}") from exc
    except OSError as exc:
        flag = "--chat-template" if ns.chat_template is not None else "--model"
        raise RoutineError(f"{flag}: cannot read the chat template: {exc}") from exc


def _gateway_workers(config: GatewayConfig, ns: argparse.Namespace) -> int:
    """`stepwise gateway --workers N`: this process holds the port and supervises N that serve it."""
    from gateway import workers
    from stepwise import gateway_worker

    try:
        sock = workers.reserve_port(ns.host, ns.port)
    except OSError as exc:
        raise RoutineError(str(exc)) from exc
    supervisor = workers.Supervisor(config, ns.host, sock, ns.workers, ns.log_level, gateway_worker.main)
    try:
        return supervisor.run(ns.ready_file)
    except workers.WorkerStartError as exc:
        raise RoutineError(str(exc)) from exc


def _quiet_grpc() -> None:
    """Keep gRPC's C core from logging below ERROR to a client's stderr (unless the caller chose).

    It logs a failed TLS handshake at INFO; the same failure reaches our one-line message anyway.
    Read when grpc is first imported, so this must run before that.
    """
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def _chat_parser() -> argparse.ArgumentParser:
    from stepwise import chat

    parser = _parser("stepwise chat", COMMANDS["chat"].summary)
    chat.add_arguments(parser)
    flags.apply_env_defaults(parser)
    return parser


def cmd_chat(argv: Sequence[str]) -> int:
    _quiet_grpc()
    from stepwise import chat

    ns = _chat_parser().parse_args(argv)
    logs.configure("warning")
    return asyncio.run(chat.run(ns, _resolve_model(ns.model)))


def _generate_parser() -> argparse.ArgumentParser:
    from clients import generate

    parser = _parser("stepwise generate", COMMANDS["generate"].summary)
    generate.add_arguments(parser)
    flags.apply_env_defaults(parser)
    return parser


def cmd_generate(argv: Sequence[str]) -> int:
    _quiet_grpc()
    from clients import generate

    ns = _generate_parser().parse_args(argv)
    gen = asyncio.run(generate.run(ns))
    return 0 if gen.finish_reason in ("stop", "length") else 1


def _bench_parser() -> argparse.ArgumentParser:
    from clients import bench

    parser = _parser("stepwise bench", COMMANDS["bench"].summary)
    bench.add_arguments(parser)
    flags.apply_env_defaults(parser)
    return parser


def cmd_bench(argv: Sequence[str]) -> int:
    _quiet_grpc()
    from clients import bench

    report = asyncio.run(bench.run(_bench_parser().parse_args(argv)))
    return 0 if report["completed"] == report["requests"] else 1


def _compare_parser() -> argparse.ArgumentParser:
    from stepwise import compare

    parser = _parser("stepwise compare", COMMANDS["compare"].summary)
    compare.add_arguments(parser)
    flags.apply_env_defaults(parser)
    return parser


def cmd_compare(argv: Sequence[str]) -> int:
    _quiet_grpc()
    from stepwise import compare

    asyncio.run(compare.run(_compare_parser().parse_args(argv)))
    return 0


_DEMO = Flags(
    None,
    (
        Flag("prompt", nargs="?", default=DEMO_PROMPT, help=f"prompt text (default: {DEMO_PROMPT!r})"),
        Flag("--max-new-tokens", Int(0, INT32_MAX), default=80, help="stop after this many new tokens"),
        Flag(
            "--model",
            default="embedded",
            help="a named model (stepwise models lists them) or a checkpoint directory (default: embedded)",
        ),
        Flag(
            "--chat",
            action=argparse.BooleanOptionalAction,
            help="send the prompt as one user turn through the model's chat template (default: on for an "
            "instruct model such as smollm2, off for embedded and for directories)",
        ),
    ),
)


def _demo_parser() -> argparse.ArgumentParser:
    parser = _parser("stepwise demo", COMMANDS["demo"].summary)
    _DEMO.add_to(parser)
    flags.apply_env_defaults(parser)
    return parser


def _demo_prompt(ns: argparse.Namespace, model_dir: Path) -> str:
    """The text the demo sends: the prompt itself, or rendered as a user turn (--chat)."""
    from gateway.chat import load_template
    from stepwise.models import wants_chat

    chat = wants_chat(ns.model) if ns.chat is None else ns.chat
    if not chat:
        return str(ns.prompt)
    template = load_template(model_dir)
    if template is None:
        raise RoutineError(f"--chat: the model in {model_dir} has no chat template")
    return template.render([{"role": "user", "content": ns.prompt}], add_generation_prompt=True)


def cmd_demo(argv: Sequence[str]) -> int:
    """Start the stack on a model (the embedded one by default), stream one generation, stop."""
    from clients import generate
    from stepwise.up import local_stack

    ns = _demo_parser().parse_args(argv)
    model_dir = _resolve_model(ns.model)
    prompt = _demo_prompt(ns, model_dir)

    async def demo() -> int:
        stack = local_stack(model_dir)
        try:
            address = await stack.start()
            print(f"[stepwise: control plane and one worker up at {address}]", flush=True)
            gen_ns = argparse.Namespace(
                prompt=prompt,
                address=address,
                max_new_tokens=ns.max_new_tokens,
                temperature=0.0,
                top_p=None,
                top_k=None,
                seed=None,
                stop=[],
                ignore_eos=False,
                wait=60.0,
                api_key=None,
                tls_ca=None,
            )
            gen = await generate.run(gen_ns, echo=None if prompt == ns.prompt else f"{ns.prompt}\n> ")
            return 0 if gen.finish_reason in ("stop", "length") else 1
        finally:
            stack.stop()

    return asyncio.run(demo())


def _models_parser() -> argparse.ArgumentParser:
    parser = _parser("stepwise models", COMMANDS["models"].summary)
    flags.apply_env_defaults(parser)
    return parser


def cmd_models(argv: Sequence[str]) -> int:
    """One line per named model: its name, what it is, and what using it would take here."""
    from stepwise.models import MODELS

    _models_parser().parse_args(argv)
    width = max(map(len, MODELS))
    for named in MODELS.values():
        print(f"{named.name:<{width}}  {named.summary}")
        print(f"{'':<{width}}  {named.status()}")
        if named.tools_template is not None:
            print(
                f"{'':<{width}}  chat template: {named.tools_template} (its own renders no tools; "
                "--chat-template overrides it)"
            )
    print("any other --model value is a checkpoint directory (config.json, safetensors, tokenizer)")
    return 0


def cmd_replay(argv: Sequence[str]) -> int:
    from stepwise import replay

    return replay.main(argv)


def _replay_parser() -> argparse.ArgumentParser:
    from stepwise import replay

    return replay.build_parser()


def cmd_simulate(argv: Sequence[str]) -> int:
    from stepwise import simulate

    return simulate.main(argv)


def _simulate_parser() -> argparse.ArgumentParser:
    from stepwise import simulate

    return simulate.build_parser()


@dataclass(frozen=True, slots=True)
class Command:
    run: Callable[[Sequence[str]], int]
    summary: str
    # The command's flags (with their STEPWISE_* defaults applied): what `run` parses its argv with.
    parser: Callable[[], argparse.ArgumentParser]


COMMANDS = {
    "control": Command(
        cmd_control, "the control plane: schedules requests, serves clients and workers", _control_parser
    ),
    "worker": Command(cmd_worker, "a data-plane worker: runs the model for a control plane", _worker_parser),
    "up": Command(cmd_up, "a control plane and N workers as child processes", _up_parser),
    "gateway": Command(
        cmd_gateway, "an OpenAI-compatible HTTP gateway in front of control planes", _gateway_parser
    ),
    "generate": Command(cmd_generate, "stream one generation to the terminal", _generate_parser),
    "chat": Command(
        cmd_chat, "a conversation in the terminal through the model's chat template", _chat_parser
    ),
    "bench": Command(cmd_bench, "load generator with serving metrics", _bench_parser),
    "compare": Command(
        cmd_compare, "stepwise against static batching and transformers on one workload", _compare_parser
    ),
    "demo": Command(
        cmd_demo, "start the stack on a model (default: embedded), stream one generation, stop", _demo_parser
    ),
    "models": Command(cmd_models, "the models --model can name, and what each needs here", _models_parser),
    "replay": Command(
        cmd_replay, "replay a recording against a fresh worker or scheduler, or show it", _replay_parser
    ),
    "simulate": Command(
        cmd_simulate, "the real scheduler on a request trace, on a simulated clock", _simulate_parser
    ),
}
USAGE = f"usage: stepwise {{{', '.join(COMMANDS)}}} [flags]"


def _help() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    footer = "stepwise COMMAND --help lists its flags; a flag --x-y can also be set as STEPWISE_X_Y."
    return "\n".join([USAGE, "", "commands:", *lines, "", footer])


def _routine_message(exc: Exception) -> str | None:
    """The one line a routine failure prints, or None when `exc` is a bug (it keeps its traceback)."""
    if isinstance(exc, RoutineError):
        return str(exc)
    import grpc

    from clients.client import NotServingError

    if isinstance(exc, NotServingError):
        return str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        status = f"{exc.code().name}: {exc.details()}"
        if exc.code().name in REFUSED_CODES:
            return f"the control plane refused the call ({status})"
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return f"lost the control plane ({status})"
    return None


def _reader_left() -> int:
    """Whoever read stdout closed it (`stepwise replay show REC | head`): stop quietly with 141, the
    status a shell reports for a process that SIGPIPE ended (128 + 13), as `cat` would give.

    stdout now points at /dev/null, so that the interpreter's own flush at exit cannot fail again."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_READER_LEFT


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            code = _dispatch(args)
        except SystemExit:  # --help, or a usage error: what it printed is flushed here too
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # here, not at exit, so that a reader gone by now is caught below
        return code
    except BrokenPipeError:
        return _reader_left()


def _dispatch(args: list[str]) -> int:
    if args and args[0] in ("-h", "--help"):
        print(_help())
        return 0
    if not args or args[0] not in COMMANDS:
        problem = f"stepwise: unknown command {args[0]!r}; " if args else ""
        print(f"{problem}{USAGE}   (stepwise --help describes the commands)", file=sys.stderr)
        return 2
    from stepwise.parent import die_with_parent

    die_with_parent()
    name = args[0]
    try:
        return COMMANDS[name].run(args[1:])
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        raise  # an OSError, yet no routine failure to report: main() ends the command quietly
    except Exception as exc:
        message = _routine_message(exc)
        if message is None:
            raise
        print(f"stepwise {name}: {' '.join(message.split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
