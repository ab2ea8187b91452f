"""`strict: true` closes every object of the schema (gateway/strict.py), for a `json_schema` response
format and a function tool's parameters alike; without it the schema goes as given."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from gateway.chat import load_template
from gateway.errors import GatewayError
from gateway.strict import closed
from stepwise.models import resolve_model
from tests.gateway.fake import FakeControlPlane, app_with, http_client


class Address(BaseModel):
    city: str
    zip_code: str | None = None


class Person(BaseModel):
    name: str
    age: int
    addresses: list[Address]


def test_every_object_is_closed_and_nothing_else_changes() -> None:
    schema = Person.model_json_schema()
    strict = closed(schema, "f")
    assert strict["additionalProperties"] is False
    assert strict["$defs"]["Address"]["additionalProperties"] is False
    assert strict["required"] == schema["required"] == ["name", "age", "addresses"]
    assert strict["$defs"]["Address"]["required"] == ["city"]  # as given
    assert strict["properties"] == schema["properties"]
    assert "additionalProperties" not in schema  # the caller's schema is not touched


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"type": "object", "additionalProperties": True}, {"type": "object", "additionalProperties": True}),
        (
            {"type": "object", "additionalProperties": {"type": "object"}},
            {"type": "object", "additionalProperties": {"type": "object", "additionalProperties": False}},
        ),
        ({"properties": {}}, {"properties": {}, "additionalProperties": False}),
        (
            {"type": "array", "items": {"anyOf": [{"type": "object"}, {"type": "string"}]}},
            {
                "type": "array",
                "items": {"anyOf": [{"type": "object", "additionalProperties": False}, {"type": "string"}]},
            },
        ),
        (
            {"allOf": [{"type": "object"}], "type": "object"},
            {"allOf": [{"type": "object"}], "type": "object"},
        ),
        ({"type": "string"}, {"type": "string"}),
    ],
)
def test_what_says_otherwise_is_kept(schema: dict[str, Any], expected: dict[str, Any]) -> None:
    assert closed(schema, "f") == expected


def test_a_schema_too_deep_to_walk_is_a_400_naming_the_field() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GatewayError) as caught:
        closed(deep, "response_format.json_schema.schema")
    assert caught.value.param == "response_format.json_schema.schema"


def _format(strict: bool | None) -> dict[str, Any]:
    json_schema: dict[str, Any] = {"name": "person", "schema": Person.model_json_schema()}
    if strict is not None:
        json_schema["strict"] = strict
    return {"type": "json_schema", "json_schema": json_schema}


@pytest.mark.parametrize("strict", [True, False, None])
async def test_the_response_formats_grammar_is_closed_only_when_strict(strict: bool | None) -> None:
    plane = FakeControlPlane()
    body = {"prompt": "x", "max_tokens": 2, "response_format": _format(strict)}
    async with http_client(app_with(plane)) as client:
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    sent = json.loads(plane.requests[0].sampling.json_schema)
    assert sent == (closed(Person.model_json_schema(), "f") if strict else Person.model_json_schema())


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
async def test_a_strict_tools_parameters_are_closed(tool_choice: object) -> None:
    plane = FakeControlPlane()
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tool = {"type": "function", "function": {"name": "add", "parameters": parameters, "strict": True}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": tool_choice}
    async with http_client(app_with(plane, load_template(resolve_model("embedded")))) as client:
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    grammar = plane.requests[0].sampling.json_schema
    assert '"additionalProperties":false' in grammar
    sent = json.loads(grammar)
    arguments = sent if tool_choice != "required" else sent["items"]["anyOf"][0]["properties"]["parameters"]
    assert arguments == {**parameters, "additionalProperties": False}
