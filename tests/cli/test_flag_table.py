"""The flag table: every flag of every command is described, and every numeric flag declares its range.

The parsers are introspected (every command of `stepwise.cli.COMMANDS`, every subcommand), so a flag
added tomorrow is held to the same rules: help text; a range stated by its `type=` (flagtypes); a
value outside it, or NaN, refused as one line `stepwise CMD: ...` naming the flag, exit 2, both on the
command line and in the flag's STEPWISE_* variable.
"""

from __future__ import annotations

import argparse
import math

import pytest

from stepwise import cli
from stepwise.flags import env_name

COMMANDS = sorted(cli.COMMANDS)


def walk(words: list[str], prefix: list[str], parser: argparse.ArgumentParser):  # type: ignore[no-untyped-def]
    """(command words, the argv that selects the subcommand, its parser) for `parser` and every
    subcommand under it."""
    found = [(" ".join(words), prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += walk([*words, name], [*prefix, name], sub)
    return found


def parsers(command: str):  # type: ignore[no-untyped-def]
    return walk([command], [], cli.COMMANDS[command].parser())


def flags_of(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every option and positional a person types (not -h, not the subcommand switch)."""
    return [
        action
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
    ]


def long_name(action: argparse.Action) -> str:
    return next((s for s in action.option_strings if s.startswith("--")), action.dest)


def ranged_flags(command: str):  # type: ignore[no-untyped-def]
    """(words, prefix, option, declared type) of every option of `command` whose type declares a range."""
    import flagtypes

    for words, prefix, parser in parsers(command):
        for action in flags_of(parser):
            if action.option_strings and isinstance(action.type, flagtypes.Ranged):
                yield words, prefix, long_name(action), action.type


def refused_values(kind: object) -> list[str]:
    """Values just outside the declared range (and NaN and infinity where a finite number is wanted)."""
    import flagtypes

    if isinstance(kind, flagtypes.IntPair):
        return [f"{kind.lo - 1},{kind.lo}", f"{kind.hi},{kind.hi + 1}", f"{kind.lo + 1},{kind.lo}", "1"]
    assert isinstance(kind, flagtypes.Int | flagtypes.Float), kind
    if isinstance(kind, flagtypes.Int):
        return [str(kind.lo - 1), str(kind.hi + 1), "1.5", "many"]
    values = ["nan", "many"]
    if kind.lo > -math.inf:
        values.append(repr(kind.lo - max(1.0, abs(kind.lo))))
    if kind.hi < math.inf:
        values += [repr(kind.hi + max(1.0, abs(kind.hi))), "inf"]
    return values


def test_the_walk_sees_every_command_and_subcommand() -> None:
    words = {w for command in COMMANDS for w, _, _ in parsers(command)}
    assert set(cli.COMMANDS) <= words
    assert {"replay worker", "replay scheduler", "replay show"} <= words


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_text(command: str) -> None:
    missing = [
        f"{words} {long_name(action)}"
        for words, _, parser in parsers(command)
        for action in flags_of(parser)
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert missing == []


@pytest.mark.parametrize("command", COMMANDS)
def test_every_numeric_flag_declares_a_range(command: str) -> None:
    import flagtypes

    undeclared = []
    for words, _, parser in parsers(command):
        for action in flags_of(parser):
            numeric_default = isinstance(action.default, int | float) and not isinstance(action.default, bool)
            plain = action.type in (int, float) or (
                action.type is None and numeric_default and isinstance(action, argparse._StoreAction)
            )
            if plain or (numeric_default and not isinstance(action.type, flagtypes.Ranged)):
                undeclared.append(f"{words} {long_name(action)}")
    assert undeclared == []


@pytest.mark.parametrize("command", COMMANDS)
def test_every_default_lies_in_its_range(command: str) -> None:
    import flagtypes

    outside = []
    for words, _, parser in parsers(command):
        for action in flags_of(parser):
            kind, default = action.type, action.default
            if isinstance(kind, flagtypes.Ranged) and default is not None and not kind.contains(default):
                outside.append(f"{words} {long_name(action)}={default!r}")
    assert outside == []


@pytest.mark.parametrize("command", COMMANDS)
def test_out_of_range_values_are_refused_on_the_command_line(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    accepted = []
    parser = cli.COMMANDS[command].parser()
    for words, prefix, flag, kind in ranged_flags(command):
        for value in refused_values(kind):
            with pytest.raises(SystemExit) as exited:
                parser.parse_args([*prefix, f"{flag}={value}"])
            err = capsys.readouterr().err
            lines = err.splitlines()
            if (
                exited.value.code != 2
                or len(lines) != 1
                or flag not in err
                or f"stepwise {words}:" not in err
            ):
                accepted.append(f"{words} {flag}={value}: exit {exited.value.code}: {err!r}")
    assert accepted == []


@pytest.mark.parametrize("command", COMMANDS)
def test_out_of_range_values_are_refused_in_the_environment(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    accepted = []
    for words, _, flag, kind in ranged_flags(command):
        for value in refused_values(kind):
            with monkeypatch.context() as env:
                env.setenv(env_name(flag), value)
                with pytest.raises(SystemExit) as exited:
                    cli.COMMANDS[command].parser()
            err = capsys.readouterr().err
            lines = err.splitlines()
            named = f"{env_name(flag)}={value}" in err and flag in err
            if exited.value.code != 2 or len(lines) != 1 or not named:
                accepted.append(f"{words} {env_name(flag)}={value}: exit {exited.value.code}: {err!r}")
    assert accepted == []


def test_process_counts_are_capped() -> None:
    """Each process count has a cap (flagtypes.MAX_PROCESSES, up's MAX_CONTROL_PLANES): a typo of a
    few digits must not fork a machine to death."""
    caps = {
        (words, flag): kind.hi
        for command in ("control", "up")
        for words, _, flag, kind in ranged_flags(command)
        if flag in ("--frontends", "--workers", "--control-planes")
    }
    assert caps == {("control", "--frontends"): 64, ("up", "--workers"): 64, ("up", "--control-planes"): 16}


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        # Harm each of these did before it was refused.
        ("control", ["--worker-step-timeout", "nan"]),  # every worker dropped at its first step
        ("control", ["--prefill-max-requests", "0"]),  # no prefill ever admitted: every call hangs
        ("control", ["--frontends", "100000000000000000000"]),  # processes without bound
        ("up", ["--control-planes", "1000"]),
        ("up", ["--workers", "1000"]),
        ("control", ["--record-max-bytes", "-1"]),  # a part file per step
        ("control", ["--waiting-timeout", "nan"]),
        ("control", ["--running-timeout", "1e30"]),
        ("control", ["--schedule-conservativeness", "-1"]),
        ("control", ["--schedule-conservativeness", "nan"]),
        ("control", ["--balance-rel-threshold", "nan"]),
        ("control", ["--drain-timeout", "1e30"]),
        ("control", ["--max-running-requests", "-3"]),  # was silently taken as 1
        ("control", ["--max-running-requests", str(10**30)]),
        ("control", ["--max-prefill-tokens", "-1"]),
        ("control", ["--decode-log-interval", "0"]),  # a division by zero at the first decode
        ("control", ["--max-concurrent-streams", str(2**31)]),  # the frontend cannot start, again and again
        ("worker", ["--host-pool-tokens", "-1"]),  # was silently taken as 0
        ("control", ["--log-level", "loud"]),
    ],
)
def test_values_that_do_harm_are_refused(
    command: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.COMMANDS[command].parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and argv[0] in err, err


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        # SGLang's special values stay: -1 (and 0) turn chunking and the timeouts off.
        ("control", ["--chunked-prefill-size", "-1"]),
        ("control", ["--chunked-prefill-size", "0"]),
        ("control", ["--waiting-timeout", "-1"]),
        ("control", ["--running-timeout", "0"]),
        ("control", ["--port", "0", "--worker-port", "65535", "--metrics-port", "0"]),
        ("control", ["--max-queued-requests", "1", "--max-running-requests", "1"]),
        ("control", ["--log-level", "WARNING"]),
        ("bench", ["--request-rate", "inf", "--max-concurrency", "0"]),
        ("worker", ["--health-port", "0", "--host-pool-tokens", "0"]),
    ],
)
def test_special_values_are_kept(command: str, argv: list[str]) -> None:
    parser = cli.COMMANDS[command].parser()
    ns = parser.parse_args(argv)
    for flag, text in zip(argv[::2], argv[1::2], strict=True):
        value = getattr(ns, parser._option_string_actions[flag].dest)
        try:
            assert float(value) == float(text), (flag, value)
        except ValueError:  # not a number: kept as given, up to case (--log-level)
            assert str(value).lower() == text.lower(), (flag, value)
