"""A command's flags as one table: each flag's name, type, help and the config field it sets, once.

    SCHEDULER_FLAGS = Flags(SchedulerConfig, (
        Flag("--max-prefill-tokens", count(1), help="prompt tokens one prefill step admits ..."),
        Flag("--disable-radix-cache", SWITCH, help="no prefix caching ..."),
        ...
    ))
    SCHEDULER_FLAGS.add_to(parser)                 # the argparse options
    SchedulerConfig(**SCHEDULER_FLAGS.values(ns))  # the frozen config they set

A flag's default is its config field's, written once in the frozen dataclass; a flag that sets no
field (or one whose value is resolved at start, like `--frontends auto`) states its own. Its
environment variable follows from its name (`--max-prefill-tokens` ↔ STEPWISE_MAX_PREFILL_TOKENS,
stepwise/flags.py applies them), and `stepwise up` passes on whatever the children's parsers, built
from these tables, define. One flag a few lines, in the order --help lists them: a flag added on
another branch merges as lines added.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


class _Field:
    """The sentinel default: take the config field's."""

    def __repr__(self) -> str:
        return "FIELD"


FIELD: Any = _Field()
# The type of a switch: present sets True (argparse's store_true), its variable takes TRUE/FALSE words.
SWITCH = "store_true"


def env_name(option: str) -> str:
    """The environment variable of a flag: `--max-queued-requests` ↔ STEPWISE_MAX_QUEUED_REQUESTS."""
    return "STEPWISE_" + option.lstrip("-").replace("-", "_").upper()


# argparse's own actions by class (a name inside Flag, whose `type` is a field, cannot say `type[...]`).
ActionClass = type[argparse.Action]


def _same(value: object) -> object:
    return value


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag and the config field it sets."""

    # `--long-name`, or a positional's name.
    name: str
    # A flagtypes type (its range is the flag's), another converter, or SWITCH; None: the text itself.
    type: Callable[[str], object] | str | None = None
    help: str = ""
    # The config field it sets: "" its own name's (`--page-size` sets page_size); None: none (the
    # command reads it from the parsed namespace itself).
    field: str | None = ""
    # FIELD: the config field's default (False for a switch).
    default: object = FIELD
    choices: Sequence[object] | None = None
    metavar: str | None = None
    nargs: str | int | None = None
    required: bool = False
    # argparse's action, when not a plain value or a SWITCH ("append", BooleanOptionalAction).
    action: str | ActionClass | None = None
    # The namespace attribute, when not the name's (`--variant` gathers into `variants`).
    dest: str = ""
    # Other names of the flag (`--requests` for `--num-prompts`); the variable is the name's.
    aliases: tuple[str, ...] = ()
    # The field's value from the flag's (`--disable-x` sets x to `not` it).
    to: Callable[[Any], object] = _same

    @property
    def attr(self) -> str:
        """Where the parsed value lands in the namespace."""
        return self.dest or self.name.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return env_name(self.name)

    @property
    def sets(self) -> str | None:
        return self.attr if self.field == "" else self.field


@dataclass(frozen=True, slots=True)
class Flags:
    """The flags whose values make one frozen config (`config`; None: flags the command reads itself)."""

    config: type | None
    flags: tuple[Flag, ...]

    def default(self, flag: Flag) -> object:
        """What the flag's value is when neither the command line nor its variable gives one."""
        if flag.default is not FIELD:
            return flag.default
        if flag.type == SWITCH:
            return False
        if flag.sets is None or self.config is None:
            return None
        return self._fields()[flag.sets].default

    def add_to(self, parser: argparse.ArgumentParser | argparse._ActionsContainer) -> None:
        for flag in self.flags:
            parser.add_argument(flag.name, *flag.aliases, **self._options(flag))

    def _options(self, flag: Flag) -> dict[str, Any]:
        """`flag` as add_argument's keywords."""
        if flag.type == SWITCH:
            return {"action": SWITCH, "help": flag.help}
        options = {"default": self.default(flag), "help": flag.help}
        for key in ("type", "action", "choices", "metavar", "nargs", "dest"):
            if getattr(flag, key) not in (None, ""):
                options[key] = getattr(flag, key)
        if flag.required:
            options["required"] = True
        return options

    def replace(self, name: str, **changes: Any) -> Flags:
        """These flags with `name`'s changed (a command that gives a shared flag its own default)."""
        assert any(f.name == name for f in self.flags), name
        flags = tuple(dataclasses.replace(f, **changes) if f.name == name else f for f in self.flags)
        return Flags(self.config, flags)

    def values(self, ns: argparse.Namespace) -> dict[str, object]:
        """The config fields the parsed flags set (each through its flag's `to`)."""
        return {flag.sets: flag.to(getattr(ns, flag.attr)) for flag in self.flags if flag.sets is not None}

    def _fields(self) -> dict[str, dataclasses.Field[object]]:
        assert self.config is not None
        return {f.name: f for f in dataclasses.fields(self.config)}


def flag_values(sections: Iterable[Flags], config: type, ns: argparse.Namespace) -> dict[str, object]:
    """The fields of `config` that the parsed flags of `sections` set."""
    return {key: value for s in sections if s.config is config for key, value in s.values(ns).items()}
