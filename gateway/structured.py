"""Constrained decoding as the gateway's callers ask for it, translated into the protocol's one
`SamplingParams.constraint`.

Callers spell a constraint in several dialects: OpenAI's `response_format`, SGLang's extra fields
(`regex`, `ebnf`, `json_schema` as text, and in /generate's `sampling_params` also
`structural_tag`), vLLM's `structured_outputs` and its older `guided_*` fields, and (chat only) a
tool choice that forces a call (gateway/tools.py). Each source becomes one `Constraint` that
remembers the caller's field, so that

- two sources in one request are a 400 naming both (the protocol holds one grammar, and picking one
  would silently drop the other), and
- the control plane's refusal of a malformed grammar (`sampling.json_schema: ...`) reaches the
  caller naming the field it came from (`response_format.json_schema.schema: ...`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import invalid
from gateway.strict import closed
from gateway.text import Text
from grammars import nesting
from protos.stepwise.v1 import generation_pb2 as gen_pb

Kind = Literal["json_schema", "regex", "ebnf", "lark", "structural_tag", "choice"]
# Any JSON object: what `response_format: {"type": "json_object"}` asks for.
ANY_OBJECT = '{"type": "object"}'


@dataclass(frozen=True, slots=True)
class Constraint:
    """One grammar for the output: the protocol's oneof member `kind` with `value`, asked for by the
    caller's field `field` (as errors name it)."""

    field: str
    kind: Kind
    value: str | tuple[str, ...]
    # Where a refusal of the grammar itself points, when not at `field` (a named tool's parameters).
    grammar_field: str = ""

    def apply(self, sampling: gen_pb.SamplingParams) -> None:
        if self.kind == "choice":
            sampling.choice.choices.extend(self.value)
        else:
            assert isinstance(self.value, str)
            setattr(sampling, self.kind, self.value)

    def renames(self) -> dict[str, str]:
        """The control plane's names for this constraint (after gateway/errors.py strips
        `sampling.`) and the caller's field they stand for."""
        name = self.grammar_field or self.field
        return {self.kind: name, f"{self.kind}.choices": name, "constraint": name}


def one_constraint(found: Iterable[Constraint | None]) -> Constraint | None:
    """The request's constraint; a 400 naming both fields when it asks for two."""
    given = [c for c in found if c is not None]
    if len(given) > 1:
        first, second = given[0], given[1]
        raise invalid(
            second.field,
            f"cannot be combined with {first.field}: a request takes one output constraint",
        )
    return given[0] if given else None


def schema_text(field: str, schema: Any) -> str:
    """A JSON Schema given as an object or as JSON text, as the protocol's JSON text. Text is
    checked here so its refusal names the caller's field before anything is queued."""
    try:
        if isinstance(schema, str):
            schema = nesting.loads(schema)
        elif isinstance(schema, dict):
            nesting.check_depth(schema)
    except nesting.TooDeep as exc:
        raise invalid(field, str(exc)) from None
    except ValueError as exc:
        raise invalid(field, f"not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise invalid(field, f"a JSON Schema is an object, got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"))


def choice_values(field: str, choices: list[str]) -> tuple[str, ...]:
    if not choices:
        raise invalid(field, "must name at least one choice")
    return tuple(choices)


def refuse_asking_extras(model: BaseModel, prefix: str) -> None:
    """A 400 naming the first extra field of `model` whose value asks for something."""
    for name, value in (model.model_extra or {}).items():
        if value not in (None, False, [], {}):
            raise invalid(f"{prefix}{name}", "not supported by this gateway")


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`. `name` and `description` are labels for the caller's
    side (they reach no model here). The schema is always enforced token by token; `strict: true`
    also closes its objects, as OpenAI's strict mode does (gateway/strict.py)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    # `schema` shadows a BaseModel attribute; the alias keeps the wire name.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`, and SGLang's `structural_tag` form of it."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        if self.type != "json_schema" and self.json_schema is not None:
            raise invalid("response_format.json_schema", f"only with type json_schema, not {self.type}")
        if self.type == "structural_tag":
            # SGLang's shape: the whole object, `type` included, is the protocol's structural tag.
            body = {"type": self.type, **(self.model_extra or {})}
            return Constraint("response_format", "structural_tag", json.dumps(body))
        refuse_asking_extras(self, "response_format.")
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint("response_format", "json_schema", ANY_OBJECT)
        if self.json_schema is None:
            raise invalid("response_format.json_schema", "required with type json_schema")
        refuse_asking_extras(self.json_schema, "response_format.json_schema.")
        field = "response_format.json_schema.schema"
        if self.json_schema.schema_ is None:
            raise invalid(field, "required: the JSON Schema the output must follow")
        schema = self.json_schema.schema_
        if self.json_schema.strict:
            schema = closed(schema, field)
        return Constraint(field, "json_schema", schema_text(field, schema))


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its `guided_*` fields' successor): one of `json` (a schema, as
    an object or JSON text), `regex`, `choice`, `grammar` (EBNF/GBNF), `json_object`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None

    def constraints(self) -> list[Constraint | None]:
        refuse_asking_extras(self, "structured_outputs.")
        p = "structured_outputs."
        found: list[Constraint | None] = []
        if self.json_ is not None:
            found.append(Constraint(f"{p}json", "json_schema", schema_text(f"{p}json", self.json_)))
        if self.regex is not None:
            found.append(Constraint(f"{p}regex", "regex", self.regex))
        if self.choice is not None:
            found.append(Constraint(f"{p}choice", "choice", choice_values(f"{p}choice", self.choice)))
        if self.grammar is not None:
            found.append(Constraint(f"{p}grammar", "ebnf", self.grammar))
        if self.json_object:
            found.append(Constraint(f"{p}json_object", "json_schema", ANY_OBJECT))
        return found


class ConstraintFields(BaseModel):
    """The constraint fields completions and chat completions share (mixed into SamplingFields)."""

    response_format: ResponseFormat | None = None
    # SGLang's extra request fields.
    regex: Text | None = None
    ebnf: Text | None = None
    json_schema: Text | None = None
    # vLLM's.
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    def constraints(self) -> list[Constraint | None]:
        """Every constraint the request's fields ask for, in field order (the first is kept in a
        conflict's message as the one combined with)."""
        found: list[Constraint | None] = [
            None if self.response_format is None else self.response_format.constraint()
        ]
        if self.regex is not None:
            found.append(Constraint("regex", "regex", self.regex))
        if self.ebnf is not None:
            found.append(Constraint("ebnf", "ebnf", self.ebnf))
        if self.json_schema is not None:
            text = schema_text("json_schema", self.json_schema)
            found.append(Constraint("json_schema", "json_schema", text))
        if self.structured_outputs is not None:
            found += self.structured_outputs.constraints()
        if self.guided_json is not None:
            text = schema_text("guided_json", self.guided_json)
            found.append(Constraint("guided_json", "json_schema", text))
        if self.guided_regex is not None:
            found.append(Constraint("guided_regex", "regex", self.guided_regex))
        if self.guided_choice is not None:
            values = choice_values("guided_choice", self.guided_choice)
            found.append(Constraint("guided_choice", "choice", values))
        if self.guided_grammar is not None:
            found.append(Constraint("guided_grammar", "ebnf", self.guided_grammar))
        return found


def refuse_with_ignore_eos(constraint: Constraint | None, ignore_eos: bool, ignore_eos_field: str) -> None:
    """A finished grammar ends the output with EOS, which ignore_eos would override: the protocol
    refuses the pair, and the gateway says so in the caller's names."""
    if constraint is not None and ignore_eos:
        raise invalid(
            ignore_eos_field,
            f"cannot be combined with {constraint.field}: a finished constraint ends the output with EOS",
        )
