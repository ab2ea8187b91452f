"""A constraint as a client gives it: a kind (json_schema, regex, ebnf, lark, structural_tag) and
its text. A list of choices becomes a regex of escaped alternatives, so backends see five kinds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grammars import nesting

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


@dataclass(frozen=True, slots=True)
class StructuralTag:
    """One structure of a structural tag: after `trigger` (a prefix of `begin`) is generated,
    `begin`, then JSON held to `schema`, then `end`."""

    trigger: str
    begin: str
    schema: dict[str, object]
    end: str


def structural_tags(text: str) -> tuple[list[StructuralTag], list[str]]:
    """SGLang's structural tag ({"structures": [{begin, schema, end}], "triggers": [...]}) read
    once for every backend, so they refuse the same texts with the same messages: the
    structures, each with the trigger that starts it, and the triggers."""
    value = check_json("structural_tag", text)
    structures = value.get("structures")
    triggers = value.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise GrammarError('needs non-empty "structures" and "triggers" lists')
    if not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError("triggers must be non-empty strings")
    tags = []
    for i, item in enumerate(structures):
        if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("begin", "end")):
            raise GrammarError(f'structures[{i}] needs "begin" and "end" strings')
        schema = item.get("schema", {})
        if not isinstance(schema, dict):
            raise GrammarError(f"structures[{i}].schema must be a JSON object")
        trigger = next((t for t in triggers if item["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"structures[{i}].begin {item['begin']!r} starts with no trigger")
        tags.append(StructuralTag(trigger, item["begin"], schema, item["end"]))
    return tags, triggers


def check_json(kind: str, text: str) -> dict[str, object]:
    """json_schema and structural_tag must be a JSON object, nested at most nesting.MAX_DEPTH
    levels (Python's reader would recurse past its limit); the object, or GrammarError."""
    try:
        value = nesting.loads(text)
    except nesting.TooDeep as exc:
        raise GrammarError(str(exc)) from None
    except ValueError as exc:
        raise GrammarError(f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise GrammarError(f"must be a JSON object, got {type(value).__name__}")
    return value
