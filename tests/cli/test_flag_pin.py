"""Every flag of every command, pinned: its env variable, default, type, choices and --help text.

The flag table (flagtypes/table.py and its users) builds the parsers; this file states what they
must come out as, one flag a line in flag_pin.jsonl, so that a change to any flag's name, variable,
default, range or help shows up here as a diff to review. A flag added or changed on purpose:
rewrite the file with `python -m tests.cli.test_flag_pin` and commit the diff with the change.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from stepwise import cli
from stepwise.flags import env_name, help_text
from tests.cli.test_flag_table import COMMANDS, flags_of, long_name, parsers

PIN = Path(__file__).with_name("flag_pin.jsonl")


def _shown(value: object) -> object:
    """A value as JSON keeps it apart from its look-alikes (2048 from '2048', a tuple from a list)."""
    return repr(value) if value is not None else None


def flag_rows() -> list[str]:
    rows = []
    for command in COMMANDS:
        for words, _, parser in parsers(command):
            for action in flags_of(parser):
                name = long_name(action)
                kind = action.type
                row = {
                    "command": words,
                    "flag": name,
                    "env": env_name(name) if action.option_strings else None,
                    "dest": action.dest,
                    "default": _shown(action.default),
                    "type": getattr(kind, "expected", getattr(kind, "__name__", _shown(kind))),
                    "choices": _shown(action.choices),
                    "action": type(action).__name__,
                    "nargs": _shown(action.nargs),
                    "metavar": _shown(action.metavar),
                    "required": action.required,
                    "help": help_text(action),
                }
                rows.append(json.dumps(row, ensure_ascii=False, sort_keys=True))
    return rows


def test_every_flag_is_as_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("STEPWISE_")]:
        monkeypatch.delenv(name)
    pinned = PIN.read_text().splitlines()
    now = flag_rows()
    assert [r for r in now if r not in pinned] == [], "changed or new (rewrite flag_pin.jsonl on purpose)"
    assert [r for r in pinned if r not in now] == [], "changed or gone (rewrite flag_pin.jsonl on purpose)"


def test_the_pin_covers_every_command_with_flags() -> None:
    pinned = {json.loads(line)["command"].split()[0] for line in PIN.read_text().splitlines()}
    with_flags = {c for c in cli.COMMANDS if any(flags_of(p) for _, _, p in parsers(c))}
    assert pinned == with_flags and len(pinned) >= 10


def test_env_var_names_stay_apart_within_a_command() -> None:
    seen: dict[tuple[str, str], str] = {}
    clashes = []
    for line in PIN.read_text().splitlines():
        row = json.loads(line)
        if row["env"] is None:
            continue
        key = (row["command"], row["env"])
        if key in seen and seen[key] != row["flag"]:
            clashes.append(key)
        seen[key] = row["flag"]
    assert clashes == []


if __name__ == "__main__":
    if any(n.startswith("STEPWISE_") for n in os.environ):
        sys.exit("unset the STEPWISE_* variables first: they change the defaults")
    PIN.write_text("\n".join(flag_rows()) + "\n")
    print(f"{PIN}: {len(flag_rows())} flags")
