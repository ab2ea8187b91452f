"""Output constraints (gateway/structured.py): what each dialect's field puts in the SamplingParams
the gateway sends, and every refusal, named in the caller's terms (a fake control plane:
tests/gateway/fake.py)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from gateway.chat import load_template
from stepwise.models import resolve_model
from tests.gateway.fake import FakeControlPlane, app_with, http_client, openai_client

pytestmark = pytest.mark.timeout(60)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "x"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


@pytest.fixture
def plane() -> FakeControlPlane:
    return FakeControlPlane()


def app(plane: FakeControlPlane):  # type: ignore[no-untyped-def]
    return app_with(plane, load_template(resolve_model("embedded")))


def sent(plane: FakeControlPlane) -> tuple[str | None, Any]:
    """The constraint of the last request sent: (oneof member, value)."""
    sampling = plane.requests[-1].sampling
    kind = sampling.WhichOneof("constraint")
    if kind is None:
        return None, None
    if kind == "choice":
        return kind, list(sampling.choice.choices)
    return kind, getattr(sampling, kind)


# (request fields, the constraint sent) on both /v1/chat/completions and /v1/completions.
SENT = [
    ({"response_format": {"type": "text"}}, (None, None)),
    ({"response_format": {"type": "json_object"}}, ("json_schema", '{"type": "object"}')),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
        ("json_schema", SCHEMA_TEXT),
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA, "strict": True, "description": "d"},
            }
        },
        # strict closes the objects (tests/gateway/test_strict.py).
        ("json_schema", json.dumps({**SCHEMA, "additionalProperties": False}, separators=(",", ":"))),
    ),
    ({"regex": "[ab]+"}, ("regex", "[ab]+")),
    ({"ebnf": 'root ::= "yes" | "no"'}, ("ebnf", 'root ::= "yes" | "no"')),
    ({"json_schema": json.dumps(SCHEMA)}, ("json_schema", SCHEMA_TEXT)),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", SCHEMA_TEXT)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, ("json_schema", SCHEMA_TEXT)),
    ({"structured_outputs": {"regex": "a+"}}, ("regex", "a+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", ["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ("ebnf", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, ("json_schema", '{"type": "object"}')),
    ({"guided_json": SCHEMA}, ("json_schema", SCHEMA_TEXT)),
    ({"guided_regex": "a+"}, ("regex", "a+")),
    ({"guided_choice": ["yes", "no"]}, ("choice", ["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, ("ebnf", 'root ::= "a"')),
    (
        {"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<f"]}},
        ("structural_tag", '{"type": "structural_tag", "structures": [], "triggers": ["<f"]}'),
    ),
]


@pytest.mark.parametrize(("fields", "expected"), SENT, ids=[json.dumps(f)[:60] for f, _ in SENT])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_each_field_sends_its_constraint(
    plane: FakeControlPlane, path: str, fields: dict[str, Any], expected: tuple[str | None, Any]
) -> None:
    base = CHAT if "chat" in path else COMPLETION
    async with http_client(app(plane)) as http:
        reply = await http.post(path, json={**base, **fields})
    assert reply.status_code == 200, reply.text
    assert sent(plane) == expected


async def test_the_official_client_sends_response_format(plane: FakeControlPlane) -> None:
    plane.reply = lambda request: '{"a": 1}'
    async with openai_client(app(plane)) as client:
        reply = await client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        )
        assert reply.choices[0].message.content == '{"a": 1}'
        assert reply.choices[0].finish_reason == "stop"
        assert sent(plane) == ("json_schema", SCHEMA_TEXT)
        # SGLang's and vLLM's fields through the client's extra_body.
        await client.completions.create(model="fake", prompt="x", extra_body={"guided_choice": ["a", "b"]})
        assert sent(plane) == ("choice", ["a", "b"])


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"json_schema": json.dumps(SCHEMA)}, ("json_schema", SCHEMA_TEXT)),
        ({"regex": "a+"}, ("regex", "a+")),
        ({"ebnf": 'root ::= "a"'}, ("ebnf", 'root ::= "a"')),
        ({"structural_tag": '{"type": "structural_tag"}'}, ("structural_tag", '{"type": "structural_tag"}')),
    ],
)
async def test_sglang_generate_sampling_params_send_their_constraint(
    plane: FakeControlPlane, fields: dict[str, Any], expected: tuple[str, str]
) -> None:
    async with http_client(app(plane)) as http:
        reply = await http.post("/generate", json={"text": "x", "sampling_params": fields})
    assert reply.status_code == 200, reply.text
    assert sent(plane) == expected


# (request fields, the param the 400 names, words its message holds), on chat and completions.
REFUSED = [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
        "response_format.json_schema.schema",
        "required",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}},
        "response_format.json_schema.schema",
        "",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format.json_schema.name",
        "",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
        "response_format.json_schema.name",
        "",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"response_format": "json"}, "response_format", ""),
    (
        {"response_format": {"type": "json_object", "json_schema": {"name": "a", "schema": {}}}},
        "response_format.json_schema",
        "only with type json_schema",
    ),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema", ""),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "x": 1}}},
        "response_format.json_schema.x",
        "",
    ),
    # Two constraints: the second is named, the first in the message.
    (
        {"response_format": {"type": "json_object"}, "regex": "a+"},
        "regex",
        "cannot be combined with response_format",
    ),
    ({"regex": "a", "guided_regex": "b"}, "guided_regex", "cannot be combined with regex"),
    (
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs.choice",
        "cannot be combined with structured_outputs.regex",
    ),
    ({"json_schema": "{", "regex": "a"}, "json_schema", "not valid JSON"),
    ({"json_schema": "[1]"}, "json_schema", "a JSON Schema is an object"),
    ({"guided_json": "nope"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "at least one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", ""),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", ""),
    ({"regex": "a", "ignore_eos": True}, "ignore_eos", "cannot be combined with regex"),
]


@pytest.mark.parametrize(
    ("fields", "param", "words"), REFUSED, ids=[json.dumps(f)[:70] for f, _, _ in REFUSED]
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_bad_constraints_are_400s_naming_the_field(
    plane: FakeControlPlane, path: str, fields: dict[str, Any], param: str, words: str
) -> None:
    base = CHAT if "chat" in path else COMPLETION
    async with http_client(app(plane)) as http:
        reply = await http.post(path, json={**base, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}:"), error
    assert words in error["message"]
    assert not plane.requests, "a refused request reached the control plane"


@pytest.mark.parametrize(
    ("path", "fields", "details", "param"),
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
            "sampling.json_schema: unsupported keyword 'x'",
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}},
            "sampling.json_schema: longer than --max-grammar-bytes",
            "response_format",
        ),
        ("/v1/completions", {"regex": "("}, "sampling.regex: unbalanced parenthesis", "regex"),
        ("/v1/completions", {"guided_grammar": "x"}, "sampling.ebnf: no rule root", "guided_grammar"),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"choice": ["a"]}},
            "sampling.choice.choices: too many",
            "structured_outputs.choice",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"json": SCHEMA}},
            "sampling.constraint: the grammar backend reads none of these forms",
            "structured_outputs.json",
        ),
        ("/v1/completions", {"max_tokens": 3}, "sampling.max_new_tokens: too many", "max_tokens"),
    ],
)
async def test_a_control_planes_refusal_names_the_callers_field(
    plane: FakeControlPlane, path: str, fields: dict[str, Any], details: str, param: str
) -> None:
    plane.refuse_with = details
    base = CHAT if "chat" in path else COMPLETION
    async with http_client(app(plane)) as http:
        reply = await http.post(path, json={**base, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["message"] == f"{param}:{details.partition(':')[2]}", error


async def test_a_control_planes_refusal_on_generate_names_sampling_params(plane: FakeControlPlane) -> None:
    plane.refuse_with = "sampling.regex: unbalanced parenthesis"
    async with http_client(app(plane)) as http:
        reply = await http.post("/generate", json={"text": "x", "sampling_params": {"regex": "("}})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "sampling_params.regex"


async def test_the_official_client_raises_bad_request_naming_the_field(plane: FakeControlPlane) -> None:
    async with openai_client(app(plane)) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(
                model="fake",
                messages=[{"role": "user", "content": "hi"}],
                response_format={"type": "json_schema", "json_schema": {"name": "a"}},
            )
    assert "response_format.json_schema.schema" in str(err.value)
