"""Tools and structured output on a real instruct model: SmolLM2-135M-Instruct behind
`stepwise up --model smollm2 --gateway-port 0` (one stack for the module), spoken to with the official
`openai` client and langchain-openai as their users write them.

SmolLM2's own template never mentions tools; `--model smollm2` serves the shipped `smollm2-tools`
template (gateway/templates.py). Every constrained answer (tool_choice required or named, a strict
schema, `with_structured_output`) must parse and validate against its schema; an unconstrained one
(auto) must be either text or a call that validates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from stepwise.models import resolve_model
from stepwise.up import stop_processes
from tests.e2e.test_gateway import Up, start_up

pytestmark = pytest.mark.timeout(300)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris in celsius?"}]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME["function"]["parameters"]}
# Enough for a call's JSON; a cut-off one would fail to parse, which is the point of checking.
MAX_TOKENS = 60
# A call's deadline: SmolLM2's first constrained call compiles its grammar on the worker, and a
# step of the 135M model on two shared cores took up to seconds while other tests ran beside it
# (a 30 s deadline timed out once so).
CALL_TIMEOUT_S = 120


class Weather(BaseModel):
    """The weather report for a city."""

    city: str
    temperature_celsius: int
    sunny: bool


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    resolve_model("smollm2")  # converted once, before the clock of the stack's start runs
    proc = None
    try:
        proc, stack = start_up(tmp_path_factory.mktemp("smollm2-tools"), "--model", "smollm2")
        yield stack
    finally:
        if proc is not None:
            stop_processes([proc], 10)


def _valid_call(name: str, arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def _langchain(up: Up) -> ChatOpenAI:
    return ChatOpenAI(
        model="smollm2",
        base_url=up.base_url,
        api_key="unused",
        max_retries=0,
        timeout=CALL_TIMEOUT_S,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )


# --- the official openai client ------------------------------------------------------------------


def test_tool_choice_required_calls_a_tool_with_valid_arguments(up: Up) -> None:
    reply = up.openai(timeout=CALL_TIMEOUT_S).chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _valid_call(call.function.name, call.function.arguments)


def test_a_named_tool_choice_calls_that_tool(up: Up) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = up.openai(timeout=CALL_TIMEOUT_S).chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    calls = reply.choices[0].message.tool_calls
    assert calls and [c.function.name for c in calls] == ["get_time"]
    _valid_call("get_time", calls[0].function.arguments)


def test_auto_answers_with_text_or_a_valid_call(up: Up) -> None:
    reply = up.openai(timeout=CALL_TIMEOUT_S).chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=[WEATHER],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    message = reply.choices[0].message
    for call in message.tool_calls or []:
        _valid_call(call.function.name, call.function.arguments)
    assert message.tool_calls or message.content


def test_a_tool_result_round_trip(up: Up) -> None:
    client = up.openai(timeout=CALL_TIMEOUT_S)
    first = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    second = client.chat.completions.create(
        model="smollm2",
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=30,
        temperature=0,
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_streamed_tool_calls_assemble_into_valid_calls(up: Up) -> None:
    stream = up.openai(timeout=CALL_TIMEOUT_S).chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        _valid_call(call["name"], call["arguments"])


def test_a_strict_pydantic_schema_gives_exactly_its_keys(up: Up) -> None:
    """Pydantic's schema leaves its objects open; strict closes them, so SmolLM2 cannot add keys."""
    reply = up.openai(timeout=CALL_TIMEOUT_S).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Report the weather in Paris as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": Weather.model_json_schema(), "strict": True},
        },
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop"
    data = json.loads(reply.choices[0].message.content or "")
    assert set(data) == set(Weather.model_fields)
    Weather.model_validate(data)


# --- langchain-openai --------------------------------------------------------------------------


def test_langchain_bound_tools_required_and_named(up: Up) -> None:
    llm = _langchain(up)
    for choice in ("required", "get_time"):
        message = llm.bind_tools([WEATHER, TIME], tool_choice=choice).invoke(ASK[0]["content"])
        assert isinstance(message, AIMessage) and message.tool_calls, message
        for call in message.tool_calls:
            jsonschema.validate(call["args"], SCHEMAS[call["name"]])
        if choice == "get_time":
            assert [c["name"] for c in message.tool_calls] == ["get_time"]


def test_langchain_tool_result_round_trip(up: Up) -> None:
    llm = _langchain(up).bind_tools([WEATHER], tool_choice="required")
    question = HumanMessage(ASK[0]["content"])
    called = llm.invoke([question])
    assert isinstance(called, AIMessage) and called.tool_calls
    result = ToolMessage('{"temperature": 21}', tool_call_id=called.tool_calls[0]["id"])
    answer = _langchain(up).bind_tools([WEATHER], tool_choice="none").invoke([question, called, result])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_structured_output(up: Up, method: str) -> None:
    prompt = "Report the weather in Paris."
    if method == "json_mode":  # json_mode holds the output to a JSON object only: the keys are asked for
        prompt += ' Answer with a JSON object with keys "city", "temperature_celsius" and "sunny".'
    structured = _langchain(up).with_structured_output(Weather, method=method, include_raw=True)
    result = structured.invoke(prompt)
    assert result["parsing_error"] is None, result
    assert isinstance(result["parsed"], Weather)


# --- guidellm -----------------------------------------------------------------------------------


def test_guidellms_default_streamed_request_completes_with_usage_on_every_chunk(up: Up) -> None:
    """guidellm's default run: its request shape (tests/gateway/test_continuous_usage.py), every
    chunk with usage, the last one the request's."""
    from tests.gateway.test_continuous_usage import GUIDELLM_CHAT

    body = {**GUIDELLM_CHAT, "model": "smollm2", "max_completion_tokens": 16}
    with httpx.Client(timeout=60) as http:
        assert http.get(f"{up.base_url}/models").json()["data"][0]["id"] == "smollm2"
        with http.stream("POST", f"{up.base_url}/chat/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("usage" in event for event in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 16  # ignore_eos
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 16
