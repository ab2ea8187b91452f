"""The gateway asks the control plane about the caller's key before it reads the body (issue 37,
item 5): a refused caller's body is never parsed, and a key taken is remembered."""

from __future__ import annotations

import pytest

from gateway import schemas
from tests.gateway.fake import FakeControlPlane, app_with, http_client

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("key", [None, "wrong"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate", "/detokenize"])
async def test_a_refused_key_is_a_401_and_its_body_is_never_parsed(
    monkeypatch: pytest.MonkeyPatch, path: str, key: str | None
) -> None:
    parsed: list[bytes] = []
    real = schemas.parse_body
    monkeypatch.setattr("gateway.app.parse_body", lambda raw, model: parsed.append(raw) or real(raw, model))
    plane = FakeControlPlane(keys=frozenset({"right"}))
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    async with http_client(app_with(plane)) as http:
        reply = await http.post(path, content=b'{"prompt": "x", "stop": ["a", "a"]}', headers=headers)
    assert reply.status_code == 401, reply.text
    assert reply.json()["error"]["code"] == "unauthenticated"
    assert not parsed and not plane.requests
    assert plane.asked == [key]


async def test_a_key_taken_is_asked_about_once() -> None:
    plane = FakeControlPlane(keys=frozenset({"right"}))
    headers = {"authorization": "Bearer right"}
    async with http_client(app_with(plane)) as http:
        for _ in range(3):
            reply = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
            assert reply.status_code == 200, reply.text
    assert plane.asked == ["right"] and len(plane.requests) == 3


def test_the_gateways_counts_are_the_control_planes_defaults() -> None:
    """What the control plane would refuse is refused at the gateway, never forwarded."""
    from control_plane.config import Limits
    from gateway import limits

    assert Limits().max_stop_strings == limits.MAX_STOP_STRINGS
    assert Limits().max_stop_chars == limits.MAX_STOP_CHARS
    assert Limits().max_stop_token_ids == limits.MAX_STOP_TOKEN_IDS


MESSAGE = {"role": "user", "content": "x"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# (path, body, the field named)
TOO_MANY = [
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 65}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a" * 2049] * 2}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [5] * 1025}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [[5]] * 257}, "prompt"),
    ("/v1/completions", {"prompt": ["x"] * 257}, "prompt"),
    ("/v1/chat/completions", {"messages": [MESSAGE] * 8193}, "messages"),
    ("/v1/chat/completions", {"messages": [MESSAGE], "tools": [TOOL] * 129}, "tools"),
    ("/generate", {"text": "x", "sampling_params": {"stop": ["a"] * 65}}, "sampling_params.stop"),
    ("/generate", {"input_ids": [[5]] * 257}, "input_ids"),
]


@pytest.mark.parametrize(("path", "body", "param"), TOO_MANY, ids=[f"{p}:{f}" for p, _, f in TOO_MANY])
async def test_counts_past_the_limits_are_refused_naming_the_field(path: str, body: dict, param: str) -> None:  # type: ignore[type-arg]
    plane = FakeControlPlane()
    async with http_client(app_with(plane)) as http:
        reply = await http.post(path, json=body)
    assert reply.status_code == 400, reply.text[:300]
    assert reply.json()["error"]["param"] == param, reply.json()
    assert not plane.requests
