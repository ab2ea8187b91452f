"""No field is silently dropped: every field of OpenAI's request schemas (read from the official
client's own type definitions) is either implemented by the gateway or refused with a 400 naming it,
unless its value asks for nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletionStreamOptionsParam
from openai.types.chat import completion_create_params as chat_params
from pydantic import BaseModel

from gateway.errors import GatewayError
from gateway.schemas import ChatCompletionRequest, CompletionRequest, parse_body

COMPLETION = {"prompt": "x"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
# A value that asks for something, for each field the gateway implements.
IMPLEMENTED: dict[str, Any] = {
    "model": "embedded",
    "max_tokens": 4,
    "max_completion_tokens": 4,
    "temperature": 0.5,
    "top_p": 0.5,
    "n": 2,
    "seed": 7,
    "stop": ["x"],
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "logit_bias": {"3": 1.5},
    "stream_options": {"include_usage": True},
    "user": "tenant-a",
    "echo": True,
    "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f"}}],
}
TOOL = [{"type": "function", "function": {"name": "f"}}]
# Per schema, where the two spell a field differently, or it needs another to ask for anything.
IMPLEMENTED_AS: dict[tuple[str, str], dict[str, Any]] = {
    ("CompletionRequest", "logprobs"): {"logprobs": 2},
    ("ChatCompletionRequest", "logprobs"): {"logprobs": True},
    ("ChatCompletionRequest", "top_logprobs"): {"logprobs": True, "top_logprobs": 2},
    ("ChatCompletionRequest", "tool_choice"): {"tools": TOOL, "tool_choice": "required"},
    ("ChatCompletionRequest", "parallel_tool_calls"): {"tools": TOOL, "parallel_tool_calls": False},
}
# A value that asks for something, for any field type the schemas use.
ASKING = {"x": 1}


def _check(schema: type[BaseModel], body: dict[str, Any]) -> None:
    parse_body(json.dumps(body).encode(), schema).refuse_unsupported()  # type: ignore[attr-defined]


def _refused_param(schema: type[BaseModel], body: dict[str, Any]) -> str | None:
    try:
        _check(schema, body)
    except GatewayError as exc:
        assert exc.status == 400, exc
        return exc.param
    return None


CASES = [
    *(
        (CompletionRequest, COMPLETION, f)
        for f in sorted(completion_params.CompletionCreateParamsBase.__annotations__)
    ),
    *(
        (ChatCompletionRequest, CHAT, f)
        for f in sorted(chat_params.CompletionCreateParamsBase.__annotations__)
    ),
]


@pytest.mark.parametrize(("schema", "base", "field"), CASES, ids=[f"{s.__name__}.{f}" for s, _, f in CASES])
def test_every_openai_field_is_implemented_or_refused_by_name(
    schema: type[BaseModel], base: dict[str, Any], field: str
) -> None:
    if field in base:
        assert schema.model_fields[field].is_required()  # the prompt or the messages
        return
    if field in schema.model_fields and field not in ("suffix", "best_of"):
        # Implemented (tests/e2e/test_gateway.py and tests/gateway check what each does): a value
        # that asks for something is accepted.
        sample = IMPLEMENTED_AS.get((schema.__name__, field))
        if sample is None:
            assert field in IMPLEMENTED, f"{field}: give it a sample value in IMPLEMENTED"
            sample = {field: IMPLEMENTED[field]}
        assert _refused_param(schema, {**base, **sample}) is None
        return
    # Refused with a value that asks for something (the type of the declared ones; anything else).
    value = {"suffix": "s", "best_of": 3}.get(field)
    assert _refused_param(schema, {**base, field: ASKING if value is None else value}) == field


def test_stream_options_fields_are_implemented_or_refused_by_name() -> None:
    for field in ChatCompletionStreamOptionsParam.__annotations__:
        body = {**CHAT, "stream": True, "stream_options": {field: True}}
        param = _refused_param(ChatCompletionRequest, body)
        assert param is None if field == "include_usage" else param == f"stream_options.{field}"
    # vLLM's, implemented (tests/gateway/test_continuous_usage.py).
    options = {"include_usage": True, "continuous_usage_stats": True}
    assert _refused_param(ChatCompletionRequest, {**CHAT, "stream": True, "stream_options": options}) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("audio", {"voice": "alloy"}),
        ("lora_path", "adapter"),
        ("some_vendor_knob", "on"),
    ],
)
def test_what_is_asked_for_and_not_implemented_is_a_400(field: str, value: object) -> None:
    assert _refused_param(ChatCompletionRequest, {**CHAT, field: value}) == field
    assert _refused_param(CompletionRequest, {**COMPLETION, field: value}) == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "required"),
    ],
)
def test_completions_take_no_tools(field: str, value: object) -> None:
    assert _refused_param(CompletionRequest, {**COMPLETION, field: value}) == field


# The constraint fields of gateway/structured.py, on both endpoints (the SGLang and vLLM extras).
CONSTRAINT_FIELDS: list[tuple[str, object]] = [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("response_format", {"type": "json_object"}),
    ("regex", "[ab]+"),
    ("ebnf", 'root ::= "a"'),
    ("json_schema", '{"type": "string"}'),
    ("structured_outputs", {"json": {"type": "string"}}),
    ("structured_outputs", {"regex": "a+"}),
    ("structured_outputs", {"choice": ["a", "b"]}),
    ("structured_outputs", {"grammar": 'root ::= "a"'}),
    ("guided_json", {"type": "string"}),
    ("guided_regex", "a+"),
    ("guided_choice", ["a"]),
    ("guided_grammar", 'root ::= "a"'),
]


@pytest.mark.parametrize(("field", "value"), CONSTRAINT_FIELDS)
def test_constraint_fields_are_implemented_on_both_endpoints(field: str, value: object) -> None:
    assert _refused_param(ChatCompletionRequest, {**CHAT, field: value}) is None
    assert _refused_param(CompletionRequest, {**COMPLETION, field: value}) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {}),
        ("logit_bias", None),
        ("tools", []),
        ("tool_choice", "none"),
        ("response_format", {"type": "text"}),
        ("parallel_tool_calls", True),
        ("store", False),
        ("metadata", {}),
        ("service_tier", "auto"),
        ("modalities", ["text"]),
        ("skip_special_tokens", True),
        ("spaces_between_special_tokens", True),
        ("separate_reasoning", True),
        ("stream_reasoning", True),
    ],
)
def test_values_that_ask_for_nothing_are_accepted(field: str, value: object) -> None:
    assert _refused_param(ChatCompletionRequest, {**CHAT, field: value}) is None
