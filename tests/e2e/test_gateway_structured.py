"""Constrained decoding and tool calling through the gateway on the real stack (`stepwise up
--gateway-port 0`, the embedded model; 127.0.0.1, ephemeral ports, always stopped).

The embedded model knows nothing of JSON: every well-formed answer here is the constraint's doing,
so each output is checked against what was asked (jsonschema for a schema, the regular expression,
the choices, a tool call's arguments against that tool's parameter schema). The schemas are
bounded (enums, short strings, no extra properties) so that even this model ends them well within
max_tokens. This needs the control plane and workers to apply SamplingParams.constraint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from stepwise.up import stop_processes
from tests.e2e.test_gateway import Up, start_up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MAX_TOKENS = 256
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "now", "description": "The time", "parameters": CLOCK}},
]
PARAMETERS = {"get_weather": WEATHER, "now": CLOCK}
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "confidence": {"enum": [1, 2, 3]},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["answer", "confidence", "note"],
    "additionalProperties": False,
}
MESSAGES: list[Any] = [{"role": "user", "content": "Is the sea blue?"}]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    proc = None
    try:
        proc, stack = start_up(tmp_path_factory.mktemp("structured"))
        yield stack
    finally:
        if proc is not None:
            stop_processes([proc])


def check_calls(calls: list[Any] | None, names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """Each call names an offered tool and its arguments validate against that tool's schema."""
    assert calls, "no tool call"
    out = []
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names, call
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def test_response_format_json_schema_whole_and_streamed(up: Up) -> None:
    client = up.openai()
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": ANSWER, "strict": True},
    }
    whole = client.chat.completions.create(
        model="embedded",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=response_format,
    )
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content or ""), ANSWER)
    stream = client.chat.completions.create(
        model="embedded",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=3,
        n=2,
        stream=True,
        response_format=response_format,
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), ANSWER)


def test_json_object_and_the_vendor_fields(up: Up) -> None:
    client = up.openai()
    anything = client.chat.completions.create(
        model="embedded",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"regex": "(yes|no), [a-z]{1,6}\\."}, re.compile(r"(yes|no), [a-z]{1,6}\.")),
        ({"guided_regex": "[0-9]{3}"}, re.compile(r"[0-9]{3}")),
        ({"guided_choice": ["red", "green", "blue"]}, {"red", "green", "blue"}),
        ({"structured_outputs": {"choice": ["left", "right"]}}, {"left", "right"}),
        ({"json_schema": json.dumps(ANSWER)}, ANSWER),
        ({"guided_json": ANSWER}, ANSWER),
        ({"structured_outputs": {"json": ANSWER}}, ANSWER),
        ({"ebnf": 'root ::= "x" [0-9] [0-9]'}, re.compile(r"x[0-9][0-9]")),
    ]
    for fields, expected in cases:
        reply = client.completions.create(
            model="embedded",
            prompt="Once upon a time",
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=fields,
        )
        text = reply.choices[0].text
        assert reply.choices[0].finish_reason == "stop", (fields, text)
        if isinstance(expected, re.Pattern):
            assert expected.fullmatch(text), (fields, text)
        elif isinstance(expected, set):
            assert text in expected, (fields, text)
        else:
            jsonschema.validate(json.loads(text), expected)


def test_sglang_generate_constraints(up: Up) -> None:
    base = up.base_url.removesuffix("/v1")
    with httpx.Client(base_url=base, timeout=60) as http:
        reply = http.post(
            "/generate",
            json={"text": "Once", "sampling_params": {"regex": "[ab]{2,4}", "max_new_tokens": 32}},
        )
        assert reply.status_code == 200, reply.text
        assert re.fullmatch("[ab]{2,4}", reply.json()["text"])
        reply = http.post(
            "/generate",
            json={
                "text": "Once",
                "sampling_params": {"json_schema": json.dumps(ANSWER), "max_new_tokens": MAX_TOKENS},
            },
        )
        assert reply.status_code == 200, reply.text
        jsonschema.validate(json.loads(reply.json()["text"]), ANSWER)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(up: Up, stream: bool) -> None:
    client = up.openai()
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, names in (("required", {"get_weather", "now"}), (named, {"get_weather"})):
        kwargs: Any = {
            "model": "embedded",
            "messages": [{"role": "user", "content": "Weather in Rome?"}],
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        if not stream:
            reply = client.chat.completions.create(**kwargs)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            calls = check_calls(choice.message.tool_calls, names)  # type: ignore[arg-type]
            assert choice.message.content is None
        else:
            merged: dict[int, dict[str, str]] = {}
            reasons = []
            for chunk in client.chat.completions.create(**kwargs, stream=True):
                for choice_delta in chunk.choices:
                    reasons.append(choice_delta.finish_reason)
                    for d in choice_delta.delta.tool_calls or []:
                        call = merged.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                        call["id"] = d.id or call["id"]
                        call["name"] = (d.function.name if d.function else None) or call["name"]
                        call["arguments"] += (d.function.arguments if d.function else None) or ""
            assert [r for r in reasons if r] == ["tool_calls"]
            as_calls = [
                openai.types.chat.ChatCompletionMessageToolCall(
                    id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]}
                )
                for _, c in sorted(merged.items())
            ]
            calls = check_calls(as_calls, names)
        if tool_choice is named:
            assert [name for name, _ in calls] == ["get_weather"]


def test_tool_choice_auto_and_a_tool_result_round_trip(up: Up) -> None:
    client = up.openai()
    reply = client.chat.completions.create(
        model="embedded",
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=32,
        temperature=0,
    )
    message = reply.choices[0].message
    if message.tool_calls:  # the tiny model rarely calls; what it calls must be well-formed
        check_calls(message.tool_calls, {"get_weather", "now"})  # type: ignore[arg-type]
        assert reply.choices[0].finish_reason == "tool_calls"
    else:
        assert isinstance(message.content, str) and reply.choices[0].finish_reason in ("stop", "length")
    history: Any = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "grey"}'},
    ]
    after = client.chat.completions.create(
        model="embedded",
        messages=history,
        tools=TOOLS,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_refusals_name_the_callers_field(up: Up) -> None:
    with httpx.Client(base_url=up.base_url, timeout=30) as http:
        bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
        cases = [
            ({"messages": MESSAGES, "response_format": bad_schema}, "response_format.json_schema.schema"),
            ({"messages": MESSAGES, "regex": "a", "guided_regex": "b"}, "guided_regex"),
            (
                {
                    "messages": MESSAGES,
                    "tools": TOOLS,
                    "tool_choice": {"type": "function", "function": {"name": "x"}},
                },
                "tool_choice",
            ),
        ]
        for body, param in cases:
            reply = http.post("/chat/completions", json=body)
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == param, reply.text
        bad_regex = http.post("/completions", json={"prompt": "x", "regex": "(unclosed"})
        assert bad_regex.status_code == 400 and bad_regex.json()["error"]["param"] == "regex", bad_regex.text


# --- LangChain ----------------------------------------------------------------------------------


class Verdict(BaseModel):
    """A verdict."""

    model_config = ConfigDict(extra="forbid")

    answer: Literal["yes", "no"]
    confidence: Literal[1, 2, 3]


class Weather(BaseModel):
    """Look up the weather in a city."""

    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Rome", "Oslo"]
    unit: Literal["c", "f"]


class Clock(BaseModel):
    """The time now."""

    model_config = ConfigDict(extra="forbid")


def chat_model(up: Up) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="embedded",
        base_url=up.base_url,
        api_key="unused",  # type: ignore[arg-type]
        max_retries=0,
        timeout=60,
        temperature=0,
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
    )


def test_langchain_structured_output(up: Up) -> None:
    model = chat_model(up)
    assert isinstance(
        model.with_structured_output(Verdict, method="json_schema", strict=True).invoke("Is it?"), Verdict
    )
    assert isinstance(
        model.with_structured_output(Verdict, method="function_calling", strict=True).invoke("Is it?"),
        Verdict,
    )


def test_langchain_bound_tools(up: Up) -> None:
    from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage

    model = chat_model(up)
    schemas = {"Weather": Weather, "Clock": Clock}
    for tool_choice in ("required", "Weather"):
        reply = model.bind_tools([Weather, Clock], tool_choice=tool_choice, strict=True).invoke("Weather?")
        assert isinstance(reply, AIMessage) and reply.tool_calls
        for call in reply.tool_calls:
            schemas[call["name"]].model_validate(call["args"])
        if tool_choice == "Weather":
            assert [c["name"] for c in reply.tool_calls] == ["Weather"]
    merged: Any = None
    for chunk in model.bind_tools([Weather, Clock], tool_choice="required", strict=True).stream("Weather?"):
        assert isinstance(chunk, AIMessageChunk)
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and merged.tool_calls
    for call in merged.tool_calls:
        schemas[call["name"]].model_validate(call["args"])
    # auto, and a tool result back into the conversation.
    auto = model.bind_tools([Weather, Clock], tool_choice="auto")
    first = auto.invoke("Weather in Paris?")
    for call in first.tool_calls:
        schemas[call["name"]].model_validate(call["args"])
    call_message = AIMessage(
        content="", tool_calls=[{"name": "Weather", "args": {"city": "Paris", "unit": "c"}, "id": "call_7"}]
    )
    second = auto.invoke(
        [HumanMessage("Weather in Paris?"), call_message, ToolMessage("sunny", tool_call_id="call_7")]
    )
    assert isinstance(second, AIMessage)
