"""Every flag is also an environment variable: `--max-queued-requests` ↔ `STEPWISE_MAX_QUEUED_REQUESTS`.

Kubernetes ConfigMaps and local runs share one vocabulary. Flags given on the command line win over
the environment, which wins over the built-in defaults. A variable's value is checked as the flag's
would be (the types of the flag table, flagtypes/), so a ConfigMap cannot slip past a range.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import flagtypes
from flagtypes.table import env_name

if TYPE_CHECKING:
    from _typeshed import SupportsWrite


@dataclass(frozen=True, slots=True)
class HelpSection:
    """A group of flags that `--help` describes but this parser does not parse (`up` passes them on)."""

    title: str
    description: str
    actions: tuple[argparse.Action, ...]


def help_text(action: argparse.Action) -> str | None:
    """`action`'s help as --help shows it: a ranged flag's range and default follow its text.
    argparse's %-template (`20%%` for 20%), as `help=` is written."""
    text = action.help
    if text is None or not isinstance(action.type, flagtypes.Ranged):
        return text
    extra = action.type.expected
    if action.default is not None and action.default != argparse.SUPPRESS:
        default = action.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
        extra += f", default {shown}"
    return f"{text} ({extra.replace('%', '%%')})"


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, plus each ranged flag's range and default after its help text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return help_text(action)


class ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, `PROG: MESSAGE`, and exit 2.

    The errors end up in terminals and pod logs, where argparse's usage block buries the one line
    that matters; the full usage is one `--help` away. Subparsers inherit the class. `help_sections`,
    when set, adds groups of flags that others parse to `--help` (built when help is asked for).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.help_sections: Callable[[], Sequence[HelpSection]] | None = None

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {' '.join(message.split())}\n")

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        # argparse swallows a failed write (`stepwise control --help | head -1`); let it reach
        # stepwise.cli.main, which ends every command whose reader left the same way.
        if message:
            (file or sys.stderr).write(message)

    def format_help(self) -> str:
        text = super().format_help()
        if self.help_sections is None:
            return text
        formatter = self._get_formatter()
        for section in self.help_sections():
            formatter.start_section(section.title)
            formatter.add_text(section.description or None)
            formatter.add_arguments(section.actions)
            formatter.end_section()
        return f"{text}\n{formatter.format_help()}"


def apply_env_defaults(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """Replace each long option's default with its environment variable's value, when set.

    The value is converted and checked as argparse would check it on the command line; a rejected
    value is a usage error through `parser.error` that names the variable and its flag
    (`STEPWISE_PORT=abc (--port): expected an integer in 0..65535, got 'abc'`), which exits 2.
    Subcommands' parsers (`replay show`) are applied too.
    """
    env = os.environ if env is None else env
    for action in parser._actions:  # argparse offers no public iterator over actions
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                apply_env_defaults(sub, env)
            continue
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest == "help":
            continue
        name = env_name(longs[0])
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            action.default = env_value(action, raw)
        except ValueError as exc:
            parser.error(f"{name}={raw} ({longs[0]}): {exc}")
        action.required = False


def env_value(action: argparse.Action, raw: str) -> object:
    """The value `raw` stands for as `action`'s default: converted by the option's type, checked
    against its choices, a one-item list for a repeatable option, a bool for a switch.

    ValueError, worded like argparse's own messages, when the option would reject `raw`.
    """
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return flagtypes.switch(raw) == isinstance(action, argparse._StoreTrueAction)
    value = _convert(action, raw)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"invalid choice (choose from {', '.join(map(str, action.choices))})")
    return [value] if isinstance(action, argparse._AppendAction) else value


def _convert(action: argparse.Action, raw: str) -> object:
    if not callable(action.type):
        return raw
    try:
        return action.type(raw)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    except (TypeError, ValueError):
        raise ValueError(f"invalid {getattr(action.type, '__name__', repr(action.type))} value") from None
