"""`stepwise replay {worker,scheduler,show} REC`: check a recording against fresh planes, or read it.

- `worker REC [REC ...] --model DIR|embedded`: a fresh worker (in this process) runs the recorded
  plans; its results are compared with the recorded ones. Workers that moved KV between them (live
  migration) are replayed together: give every one's recording, and each plan that receives a
  transfer runs once the plan that sent it has.
- `scheduler REC`: the recorded calls go into a fresh scheduler; its plans are compared.
- `show REC [--json]`: the recording as a timeline, one entry per step.

REC is a recording file (`<worker>-<n>.0000.rec`; later parts are followed), a session name, or a
directory holding one session; recordings made by an older format are refused. Exit codes: 0
identical / shown, 1 diverged or damaged (a damaged record anywhere but a torn tail), 2 unreadable
input. The replays' last line says how many of the recording's complete records were checked.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

from control_plane.record import codec as record_codec
from control_plane.record.entries import Entry, Header
from control_plane.record.files import DamagedRecording, RecordingError, RecordingReader, read_header
from control_plane.record.replay import ReplayReport, replay_scheduler, replay_workers
from control_plane.record.timeline import StepLine, TimelineBuilder
from flagtypes.table import SWITCH, Flag, Flags
from stepwise import flags
from stepwise.wire import Executor, WireLink

EXIT_IDENTICAL, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 2


# --- the worker --------------------------------------------------------------------------------------


def fresh_executor(header: Header, model: str, device: str, dtype: str) -> Executor:
    """A worker like the recorded one: the sim backend for a sim recording, else the model in DIR."""
    limits = header.limits
    if limits.dtype == "sim":
        return _sim_executor(header)  # everything the simulator depends on is in the header
    from data_plane import worker  # torch is loaded only for a model worker
    from data_plane.config import DTYPES, WorkerConfig
    from data_plane.models.loader import ModelLoadError
    from stepwise.models import resolve_model

    if not model:
        raise ValueError("--model DIR (or 'embedded') is needed to replay a model worker")
    if dtype == "auto" and limits.dtype in DTYPES:
        dtype = limits.dtype
    config = WorkerConfig(
        model=resolve_model(model),
        device=device,
        dtype=dtype,
        kv_tokens=limits.kv_capacity_tokens,
        page_size=limits.page_size,
        host_pool_tokens=limits.host_pool_capacity_tokens,
    )
    try:
        loaded = worker.load_worker(config)
    except ModelLoadError as exc:
        raise ValueError(f"cannot load {config.model}: {exc}") from exc
    _check_fingerprint(header, loaded.hello.model_fingerprint)
    return loaded.executor


def _sim_executor(header: Header) -> Executor:
    from data_plane.sim import SimExecutor

    limits = header.limits
    eos = min(limits.eos_token_ids) if limits.eos_token_ids else 0
    seed = int(header.seeds.get("sim.seed", 0))
    return SimExecutor(limits.kv_capacity_tokens, limits.vocab_size, eos, seed=seed)


def _check_fingerprint(header: Header, fingerprint: str) -> None:
    recorded = header.limits.model_fingerprint
    if recorded and recorded != fingerprint:
        warnings.warn(
            f"model fingerprint {fingerprint[:16]} differs from the recorded {recorded[:16]}", stacklevel=2
        )


# --- show --------------------------------------------------------------------------------------------


def timeline(entries: Iterable[Entry]) -> Iterable[StepLine]:
    builder = TimelineBuilder()
    for entry in entries:
        yield from builder.feed(entry)
    yield from builder.finish()


def print_table(lines: Sequence[StepLine]) -> None:
    """A readable table of timeline lines (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for name in ("step", "kind", "extends", "decodes", "retracted", "finished", "ratio", "rem tot/in/chunk"):
        table.add_column(name)
    for name in ("cached", "run", "queue", "kv used"):
        table.add_column(name, justify="right")
    for line in lines:
        table.add_row(*_row(line))

    class ToStdout(Console):
        def on_broken_pipe(self) -> None:
            # rich would exit 1 here; stepwise.cli.main ends every command the same way instead.
            raise BrokenPipeError(errno.EPIPE, "the reader of stdout left")

    ToStdout(width=200).print(table)


def _row(line: StepLine) -> list[str]:
    extends = " ".join(f"{e.rid}[{e.start}:{e.end}]{'+' if e.chunked else ''}" for e in line.extends)
    ended = [*line.finished, *(f"{rid}!" for rid, _ in line.aborted)]
    rem = "/".join("-" if v is None else str(int(v)) for v in _rems(line))
    return [
        str(line.step),
        line.kind,
        _clip(extends),
        str(len(line.decodes)) if line.decodes else "",
        _clip(" ".join(line.retracted)),
        _clip(" ".join(ended)),
        f"{line.new_token_ratio:.4f}",
        rem,
        str(line.cached_tokens),
        str(line.running),
        str(line.queued),
        f"{line.kv_used}/{line.kv_capacity}",
    ]


def _rems(line: StepLine) -> tuple[float | None, ...]:
    return (line.rem_total_tokens, line.rem_input_tokens, line.rem_chunk_tokens)


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


# --- command line ------------------------------------------------------------------------------------


RECORDING_HELP = (
    "a recording file (WORKER-N.0000.rec; later parts are followed), a session name, or a directory "
    "holding one session, as --record wrote it"
)


_RECORDING = Flags(None, (Flag("recording", Path, help=RECORDING_HELP),))
_WORKER = Flags(
    None,
    (
        Flag("recording", Path, nargs="+", help=RECORDING_HELP + "; several: workers replayed together"),
        Flag("--model", default="", help="model DIR or 'embedded' (not needed for a sim recording)"),
        Flag("--device", default="cpu", help="where the fresh worker runs: cpu, cuda or cuda:N"),
        Flag("--dtype", default="auto", help="auto: the recorded worker's dtype"),
    ),
)
_SHOW = Flags(None, (*_RECORDING.flags, Flag("--json", SWITCH, help="one JSON object per step")))


def build_parser() -> argparse.ArgumentParser:
    parser = flags.ArgumentParser(prog="stepwise replay", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    _WORKER.add_to(sub.add_parser("worker", help="recorded plans into a fresh worker; compare results"))
    _RECORDING.add_to(
        sub.add_parser("scheduler", help="recorded calls into a fresh scheduler; compare plans")
    )
    _SHOW.add_to(sub.add_parser("show", help="the recording as a timeline"))
    flags.apply_env_defaults(parser)
    return parser


def _report(report: ReplayReport, reader: RecordingReader) -> int:
    print(f"{report.describe()} ({reader.summary()})")
    return EXIT_IDENTICAL if report.identical else EXIT_DIVERGED


def _checked_header(path: Path) -> Header:
    header = read_header(path)
    refusal = record_codec.unsupported_format(header)
    if refusal:
        raise RecordingError(f"{path}: {refusal}")
    return header


def _replay_workers(ns: argparse.Namespace) -> int:
    """Every recording's plans into a fresh worker of its own; transfers go through one store."""
    from data_plane.kv_transfer import LoopbackTransfers, TransferStore

    headers = [_checked_header(path) for path in ns.recording]
    readers = [RecordingReader(path) for path in ns.recording]
    store = TransferStore(capacity_bytes=1 << 62)
    links = []
    for header in headers:
        executor = fresh_executor(header, ns.model, ns.device, ns.dtype)
        if hasattr(executor, "transfers"):  # a model worker: the sim backend moves no KV
            executor.transfers = LoopbackTransfers(store)
        # One link per session: the plans' decode sets travel as deltas, as they did live.
        links.append(WireLink(executor))
    reports = replay_workers(
        [r.entries() for r in readers], [link.step for link in links], store.__contains__
    )
    worst = EXIT_IDENTICAL
    for path, report, reader in zip(ns.recording, reports, readers, strict=True):
        if len(readers) > 1:
            print(f"{path}:", end=" ")
        worst = max(worst, _report(report, reader))
    return worst


def _run(ns: argparse.Namespace) -> int:
    if ns.what == "worker":
        return _replay_workers(ns)
    _checked_header(ns.recording)
    reader = RecordingReader(ns.recording)
    entries = reader.entries()
    if ns.what == "scheduler":
        return _report(replay_scheduler(entries), reader)
    if ns.json:
        for line in timeline(entries):
            print(json.dumps(line.to_json()))
    else:
        print_table(list(timeline(entries)))
    return EXIT_IDENTICAL


def _print_warning(message: object, category: object, *_args: object, **_kw: object) -> None:
    print(f"warning: {message}", file=sys.stderr)


def main(argv: Sequence[str]) -> int:
    ns = build_parser().parse_args(argv)
    warnings.showwarning = _print_warning
    try:
        return _run(ns)
    except BrokenPipeError:  # the reader left (`| head`): stepwise.cli.main ends the command
        raise
    except DamagedRecording as exc:
        print(f"stepwise replay: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    except (RecordingError, OSError, ValueError) as exc:
        print(f"stepwise replay: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
