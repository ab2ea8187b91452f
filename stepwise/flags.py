"""Every flag is also an environment variable: `--max-queued-requests` ↔ `STEPWISE_MAX_QUEUED_REQUESTS`.

Kubernetes ConfigMaps and local runs share one vocabulary. Flags given on the command line win over
the environment, which wins over the built-in defaults.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import NoReturn

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


class ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, `PROG: MESSAGE`, and exit 2.

    The errors end up in terminals and pod logs, where argparse's usage block buries the one line
    that matters; the full usage is one `--help` away. Subparsers inherit the class.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {' '.join(message.split())}\n")


def env_name(option: str) -> str:
    return "STEPWISE_" + option.lstrip("-").replace("-", "_").upper()


def apply_env_defaults(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """Replace each long option's default with its environment variable's value, when set.

    The value is converted and checked as argparse would check it on the command line; a rejected
    value is a usage error through `parser.error` that names the variable
    (`STEPWISE_PORT=abc: invalid int value`), which exits 2.
    """
    env = os.environ if env is None else env
    for action in parser._actions:  # argparse offers no public iterator over actions
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
            parser.error(f"{name}={raw}: {exc}")
        action.required = False


def env_value(action: argparse.Action, raw: str) -> object:
    """The value `raw` stands for as `action`'s default: converted by the option's type, checked
    against its choices, a one-item list for a repeatable option, a bool for a switch.

    ValueError, worded like argparse's own messages, when the option would reject `raw`.
    """
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        word = raw.strip().lower()
        if word not in TRUE + FALSE:
            raise ValueError(f"not a switch value (use one of {', '.join(TRUE + FALSE)})")
        return (word in TRUE) == isinstance(action, argparse._StoreTrueAction)
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
