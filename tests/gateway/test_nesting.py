"""Deep nesting anywhere in a request, JSON text inside a string field included, is a 400 naming the
field (issue 37, item 6: these were plain-text 500s), and nothing reaches the control plane."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.chat import load_template
from stepwise.models import resolve_model
from tests.gateway.fake import FakeControlPlane, app_with, http_client

pytestmark = pytest.mark.timeout(60)


def _deep_text(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def _deep_value(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


def _tool_call(arguments: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": _deep_value(300)}}

# (path, body, the field the 400 names)
DEEP = [
    ("/v1/completions", {"prompt": "x", "json_schema": _deep_text(5000)}, "json_schema"),
    ("/v1/completions", {"prompt": "x", "guided_json": _deep_text(5000)}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_json": _deep_text(500)}, "guided_json"),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"json": _deep_text(5000)}},
        "structured_outputs.json",
    ),
    (
        "/generate",
        {"text": "x", "sampling_params": {"json_schema": _deep_text(5000)}},
        "sampling_params.json_schema",
    ),
    (
        "/v1/chat/completions",
        {"messages": [*MESSAGES, _tool_call(_deep_text(5000))]},
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": _deep_value(300)},
            },
        },
        "response_format",
    ),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL]}, "tools"),
]


@pytest.mark.parametrize(("path", "body", "param"), DEEP, ids=[f"{p}:{f}" for p, _, f in DEEP])
async def test_deep_nesting_is_a_400_naming_the_field(path: str, body: dict[str, Any], param: str) -> None:
    plane = FakeControlPlane()
    async with http_client(app_with(plane, load_template(resolve_model("embedded")))) as http:
        reply = await http.post(
            path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert "nested" in error["message"], error
    assert not plane.requests


async def test_a_body_nested_past_the_parsers_limit_names_its_field() -> None:
    """Deeper than Python's json reader goes: the field is found by a scan of the text."""
    plane = FakeControlPlane()
    raw = b'{"prompt": "x", "logit_bias": ' + b'{"1":' * 5000 + b"1" + b"}" * 5000 + b"}"
    async with http_client(app_with(plane)) as http:
        reply = await http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text[:300]
    assert reply.json()["error"]["param"] == "logit_bias"
    assert not plane.requests
