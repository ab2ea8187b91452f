"""The flag tables (flagtypes/table.py): each flag names a field of its config, and a flag's default
is its field's, so that a config built from no flags is the config's own default."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from control_plane import config as control
from data_plane import config as worker
from flagtypes.table import FIELD, SWITCH, Flag, Flags, flag_values
from gateway import server as gateway

# Resolved when the command starts, not a field's default: `--frontends auto` counts the CPUs, an
# empty `--worker-id` is hostname-pid, `--max-connections` follows the open-file limit.
RESOLVED_AT_START = {"--frontends", "--worker-id", "--max-connections"}
TABLES = {"control": control.FLAGS, "worker": (worker.FLAGS,), "gateway": (gateway.LIMIT_FLAGS,)}


def _sections():  # type: ignore[no-untyped-def]
    return [(name, s) for name, sections in TABLES.items() for s in sections if s.config is not None]


@pytest.mark.parametrize(("command", "section"), _sections())
def test_every_flag_sets_a_field_of_its_config(command: str, section: Flags) -> None:
    assert section.config is not None
    fields = {f.name for f in dataclasses.fields(section.config)}
    assert [f.name for f in section.flags if f.sets is not None and f.sets not in fields] == []


@pytest.mark.parametrize(("command", "section"), _sections())
def test_a_flags_default_is_its_fields(command: str, section: Flags) -> None:
    assert section.config is not None
    defaults = {f.name: f.default for f in dataclasses.fields(section.config)}
    wrong = [
        f"{flag.name}: {flag.to(section.default(flag))!r} != {defaults[flag.sets]!r}"
        for flag in section.flags
        if flag.sets is not None
        and flag.name not in RESOLVED_AT_START
        and flag.to(section.default(flag)) != defaults[flag.sets]
    ]
    assert wrong == []


@pytest.mark.parametrize(("command", "section"), _sections())
def test_no_default_is_written_twice(command: str, section: Flags) -> None:
    """A flag that sets a field states no default of its own unless it is not the field's value."""
    assert section.config is not None
    defaults = {f.name: f.default for f in dataclasses.fields(section.config)}
    twice = [
        flag.name
        for flag in section.flags
        if flag.sets is not None and flag.default is not FIELD and flag.default == defaults[flag.sets]
    ]
    assert twice == []


def test_no_flags_build_the_default_control_config() -> None:
    parser = argparse.ArgumentParser()
    control.add_arguments(parser)
    ns = parser.parse_args(["--frontends", "1"])
    built = control.control_config_from_args(ns, Path("."), "")
    assert built == control.ControlConfig(Path("."))


def test_a_flag_reaches_its_field_through_its_conversion() -> None:
    parser = argparse.ArgumentParser()
    control.add_arguments(parser)
    ns = parser.parse_args(
        ["--disable-kv-balance", "--routing-policy", "least-loaded", "--waiting-timeout", "3"]
    )
    built = control.control_config_from_args(ns, Path("."), "")
    assert (built.kv_balance, built.routing.cache_aware, built.waiting_timeout_s) == (False, False, 3.0)
    assert (
        control.scheduler_config_from_args(
            parser.parse_args(["--chunked-prefill-size", "0"])
        ).chunked_prefill_size
        is None
    )


def test_no_flags_build_the_default_worker_config() -> None:
    parser = argparse.ArgumentParser()
    worker.add_arguments(parser)
    built = worker.config_from_args(parser.parse_args(["--model", "m", "--worker-id", "w"]))
    assert built == worker.WorkerConfig(model=Path("m"), worker_id="w")
    built = worker.config_from_args(parser.parse_args(["--model", "m", "--disable-decode-cache"]))
    assert (built.decode_cache, built.worker_id) == (False, worker.default_worker_id())


def test_a_section_of_flags_the_command_reads_itself() -> None:
    """No config: each flag states its default, and sets no field."""
    section = Flags(
        None, (Flag("--n", int, default=3, field=None, help="n"), Flag("--on", SWITCH, field=None, help="on"))
    )
    parser = argparse.ArgumentParser()
    section.add_to(parser)
    assert vars(parser.parse_args([])) == {"n": 3, "on": False}
    assert flag_values([section], object, parser.parse_args([])) == {}


# `python -m stepwise.smollm2 build` and `python -m stepwise.embedded build`: the tools that make the
# shipped checkpoints, not commands of `stepwise`.
CHECKPOINT_BUILDERS = {"stepwise/smollm2.py", "stepwise/embedded.py"}


def test_commands_declare_flags_in_tables_only() -> None:
    """A flag added with a bare add_argument would bypass the table (and this file's checks)."""
    root = Path(__file__).resolve().parents[2]
    bare = [
        f"{path.relative_to(root)}:{number}"
        for package in ("stepwise", "clients", "gateway", "control_plane", "data_plane")
        for path in sorted((root / package).rglob("*.py"))
        if str(path.relative_to(root)) not in CHECKPOINT_BUILDERS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ".add_argument(" in line
    ]
    assert bare == []


def test_a_flags_variable_sets_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable a table entry names is the one the command reads (stepwise.flags)."""
    from stepwise import cli

    flag = next(f for s in control.FLAGS for f in s.flags if f.name == "--max-prefill-tokens")
    assert flag.env == "STEPWISE_MAX_PREFILL_TOKENS"
    monkeypatch.setenv(flag.env, "4096")
    ns = cli.COMMANDS["control"].parser().parse_args([])
    assert control.scheduler_config_from_args(ns, env={}).max_prefill_tokens == 4096
