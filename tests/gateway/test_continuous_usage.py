"""`stream_options.continuous_usage_stats` as vLLM gives it (usage on every chunk), and guidellm's
default request shape, sent exactly as its OpenAI backend builds it (src/guidellm/backends/openai/
request_handlers.py: `format` of the chat and text completions handlers)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.chat import ChatTemplate
from tests.gateway.fake import FakeControlPlane, app_with, http_client

TEMPLATE = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")

# guidellm's body for one request of its default run (synthetic data, fixed output tokens, streamed).
GUIDELLM_CHAT: dict[str, Any] = {
    "model": "fake",
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_completion_tokens": 5,
    "stop": None,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "a synthetic prompt"}]}],
}
GUIDELLM_TEXT: dict[str, Any] = {
    "model": "fake",
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_tokens": 5,
    "stop": None,
    "ignore_eos": True,
    "prompt": "a synthetic prompt",
}


def _events(body: str) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in body.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _text(choice: dict[str, Any]) -> str:
    return str(choice.get("text") or choice.get("delta", {}).get("content") or "")


async def _post(path: str, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]], FakeControlPlane]:
    plane = FakeControlPlane()
    async with http_client(app_with(plane, TEMPLATE)) as client:
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        return response.status_code, _events(response.text), plane


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", GUIDELLM_CHAT), ("/v1/completions", GUIDELLM_TEXT)]
)
async def test_guidellms_default_request_gets_usage_on_every_chunk(path: str, body: dict[str, Any]) -> None:
    _, events, plane = await _post(path, body)
    prompt_tokens = len(plane.tokenizer.encode(plane.requests[0].text))
    with_choices = [e for e in events if e["choices"]]
    assert with_choices and all("usage" in e for e in events)
    text_events = [
        e
        for e in with_choices
        if e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content")
    ]
    # Each chunk counts the tokens generated so far, as vLLM's does; the prompt from the first chunk.
    assert [e["usage"]["completion_tokens"] for e in text_events] == [1, 2, 3, 4, 5]
    for e in events:
        usage = e["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The last event is include_usage's: no choices, the whole request's usage.
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


async def test_continuous_usage_stats_needs_include_usage() -> None:
    plane = FakeControlPlane()
    body = {**GUIDELLM_CHAT, "stream_options": {"continuous_usage_stats": True}}
    async with http_client(app_with(plane, TEMPLATE)) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    assert not plane.requests


async def test_without_continuous_usage_stats_only_the_last_event_has_usage() -> None:
    body = {**GUIDELLM_CHAT, "stream_options": {"include_usage": True}}
    _, events, _ = await _post("/v1/chat/completions", body)
    assert [("usage" in e) for e in events] == [False] * (len(events) - 1) + [True]


async def test_chat_template_kwargs_reach_the_template() -> None:
    template = ChatTemplate(
        "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    plane = FakeControlPlane()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with http_client(app_with(plane, template)) as client:
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        kwargs = {**body, "chat_template_kwargs": {"shout": True}}
        assert (await client.post("/v1/chat/completions", json=kwargs)).status_code == 200
        taken = {**body, "chat_template_kwargs": {"messages": []}}
        refused = await client.post("/v1/chat/completions", json=taken)
    assert [r.text for r in plane.requests] == ["hi", "LOUD hi"]
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs.messages"


async def test_documents_reach_a_template_that_renders_them_and_are_refused_by_one_that_cannot() -> None:
    rag = ChatTemplate(
        "{% for d in documents %}[{{ d.text }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "documents": [{"text": "doc"}]}
    plane = FakeControlPlane()
    async with http_client(app_with(plane, rag)) as client:
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    async with http_client(app_with(plane, TEMPLATE)) as client:
        refused = await client.post("/v1/chat/completions", json=body)
    assert [r.text for r in plane.requests] == ["[doc]hi"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "documents"
