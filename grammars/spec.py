"""A constraint as a client gives it: a kind (json_schema, regex, ebnf, lark, structural_tag) and
its text. A list of choices becomes a regex of escaped alternatives, so backends see five kinds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("json_schema", "regex", "ebnf", "lark", "structural_tag")
# The client protocol's name for a choice list (SamplingParams.choice); it arrives at a backend as
# a regex.
CHOICE = "choice"
# Characters that mean something in a regex; every other character of a choice stands for itself
# (a conservative set that both backends' regex dialects accept escaped).
_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}/-")


class GrammarError(ValueError):
    """A constraint that cannot be used; the message says why (the caller names the field)."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One constraint: `kind` is one of KINDS, `text` the grammar in that form."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (one of {', '.join(KINDS)})")

    @property
    def size(self) -> int:
        """Bytes of the grammar's text (what --max-grammar-bytes bounds)."""
        return len(self.text.encode("utf-8", "surrogatepass"))


def escape_regex(text: str) -> str:
    """`text` as a regex that matches exactly it."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def from_choices(choices: Sequence[str]) -> GrammarSpec:
    """The regex matching exactly one of `choices` (at least one, none empty, none repeated)."""
    if not choices:
        raise GrammarError("must list at least one choice")
    for i, choice in enumerate(choices):
        if not choice:
            raise GrammarError(f"choice {i} is empty")
    if len(set(choices)) != len(choices):
        raise GrammarError("lists a choice twice")
    return GrammarSpec("regex", "(" + "|".join(escape_regex(c) for c in choices) + ")")


def check_json(kind: str, text: str) -> None:
    """json_schema and structural_tag must be a JSON object; GrammarError otherwise."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise GrammarError(f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise GrammarError(f"must be a JSON object, got {type(value).__name__}")
