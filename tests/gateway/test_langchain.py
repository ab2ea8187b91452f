"""LangChain's OpenAI chat model against the gateway: structured output (json_schema and
function_calling), bound tools under tool_choice required, named and auto, a tool-result round trip
and streamed tool calls (the real app through ASGI, a fake control plane answering scripted text:
tests/gateway/fake.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from gateway.chat import load_template
from protos.stepwise.v1 import generation_pb2 as gen_pb
from stepwise.models import resolve_model
from tests.gateway.fake import FakeControlPlane, app_with

pytestmark = pytest.mark.timeout(60)


class Person(BaseModel):
    """A person."""

    name: str = Field(description="their name")
    age: int


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def plane() -> FakeControlPlane:
    return FakeControlPlane()


def model(plane: FakeControlPlane) -> ChatOpenAI:
    app = app_with(plane, load_template(resolve_model("embedded")))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=10)
    return ChatOpenAI(
        model="fake",
        base_url="http://gateway/v1",
        api_key="unused",  # type: ignore[arg-type]
        http_async_client=http,
        max_retries=0,
        temperature=0,
    )


def schema_sent(plane: FakeControlPlane) -> Any:
    sampling: gen_pb.SamplingParams = plane.requests[-1].sampling
    assert sampling.WhichOneof("constraint") == "json_schema"
    return json.loads(sampling.json_schema)


async def test_with_structured_output_json_schema(plane: FakeControlPlane) -> None:
    plane.reply = lambda request: '{"name": "Ada", "age": 36}'
    person = await model(plane).with_structured_output(Person, method="json_schema").ainvoke("Who?")
    assert person == Person(name="Ada", age=36)
    schema = schema_sent(plane)
    assert (
        schema["properties"]["age"] == {"type": "integer"} or schema["properties"]["age"]["type"] == "integer"
    )
    assert set(schema["required"]) == {"name", "age"}


async def test_with_structured_output_function_calling(plane: FakeControlPlane) -> None:
    plane.reply = lambda request: '{"name": "Ada", "age": 36}'
    structured = model(plane).with_structured_output(Person, method="function_calling")
    assert await structured.ainvoke("Who?") == Person(name="Ada", age=36)
    # A named tool choice: the output is held to the tool's parameter schema.
    assert set(schema_sent(plane)["properties"]) == {"name", "age"}
    assert "<tools>" in plane.requests[-1].text and '"name": "Person"' in plane.requests[-1].text


async def test_bind_tools_required(plane: FakeControlPlane) -> None:
    text = json.dumps(
        [
            {"name": "get_weather", "parameters": {"city": "Paris"}},
            {"name": "add", "parameters": {"a": 2, "b": 3}},
        ]
    )
    plane.reply = lambda request: text
    reply = await model(plane).bind_tools([get_weather, add], tool_choice="required").ainvoke("Go")
    assert isinstance(reply, AIMessage)
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 2, "b": 3}),
    ]
    assert all(c["id"] and c["id"].startswith("call_") for c in reply.tool_calls)
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    names = [b["properties"]["name"]["enum"] for b in schema_sent(plane)["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]]


async def test_bind_tools_named(plane: FakeControlPlane) -> None:
    plane.reply = lambda request: '{"a": 4, "b": 5}'
    reply = await model(plane).bind_tools([get_weather, add], tool_choice="add").ainvoke("4 + 5?")
    assert isinstance(reply, AIMessage)
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("add", {"a": 4, "b": 5})]
    assert set(schema_sent(plane)["properties"]) == {"a", "b"}


async def test_bind_tools_auto_and_a_tool_result_round_trip(plane: FakeControlPlane) -> None:
    replies = iter(
        ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "Sunny."]
    )
    plane.reply = lambda request: next(replies)
    bound = model(plane).bind_tools([get_weather, add], tool_choice="auto")
    history: list[Any] = [HumanMessage("Weather in Paris?")]
    first = await bound.ainvoke(history)
    assert isinstance(first, AIMessage) and first.content == ""
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert plane.requests[-1].sampling.WhichOneof("constraint") is None
    call = first.tool_calls[0]
    history += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    second = await bound.ainvoke(history)
    assert second.content == "Sunny." and not second.tool_calls  # type: ignore[attr-defined]
    prompt = plane.requests[-1].text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert prompt.endswith("Tool: <tool_response>\nsunny\n</tool_response>\nAssistant:")


@pytest.mark.parametrize(
    ("tool_choice", "text"),
    [
        (
            "required",
            json.dumps(
                [
                    {"name": "add", "parameters": {"a": 1, "b": 2}},
                    {"name": "get_weather", "parameters": {"city": "Rome"}},
                ]
            ),
        ),
        (
            "auto",
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
        ),
    ],
)
async def test_streamed_tool_calls(plane: FakeControlPlane, tool_choice: str, text: str) -> None:
    plane.reply = lambda request: text
    bound = model(plane).bind_tools([get_weather, add], tool_choice=tool_choice)
    merged: AIMessageChunk | None = None
    async for chunk in bound.astream("Go"):
        assert isinstance(chunk, AIMessageChunk)
        merged = chunk if merged is None else merged + chunk
    assert merged is not None
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [
        ("add", {"a": 1, "b": 2}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert merged.response_metadata.get("finish_reason") == "tool_calls"


async def test_streamed_named_tool_call_arrives_in_fragments(plane: FakeControlPlane) -> None:
    plane.reply = lambda request: '{"a": 10, "b": 20}'
    chunks = [c async for c in model(plane).bind_tools([add], tool_choice="add").astream("Go")]
    fragments = [tc for c in chunks for tc in c.tool_call_chunks]  # type: ignore[attr-defined]
    assert len(fragments) > 2 and fragments[0]["name"] == "add"
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c  # type: ignore[assignment]
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("add", {"a": 10, "b": 20})]  # type: ignore[attr-defined]
