"""The request's `model` is checked: a model the gateway does not serve is a 404 `model_not_found`
(vLLM's answer), and every name of --served-model-name is served."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.app import create_app
from tests.gateway.fake import FakeControlPlane, app_with, http_client

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


def _app(plane: FakeControlPlane, aliases: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    app = app_with(plane, model_name="team/m")
    config = dataclasses.replace(app.state.gateway.config, model_aliases=aliases)
    served = create_app(config)
    served.state.gateway._client = plane
    return served


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_model_not_served_is_a_404_before_anything_is_generated(path: str) -> None:
    plane = FakeControlPlane()
    body = {**CHAT, "prompt": "x", "model": "gpt-4o"}
    async with http_client(_app(plane)) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "'gpt-4o'" in error["message"] and "'team/m'" in error["message"]
    assert not plane.requests


async def test_every_served_name_answers_and_is_echoed() -> None:
    plane = FakeControlPlane()
    async with http_client(_app(plane, ("m", "alias"))) as client:
        listed = (await client.get("/v1/models")).json()["data"]
        answers = [
            await client.post("/v1/completions", json={**COMPLETION, "model": m}) for m in ("m", "team/m")
        ]
        unnamed = await client.post("/v1/completions", json=COMPLETION)
        retrieved = await client.get("/v1/models/alias")
        missing = await client.get("/v1/models/gpt-4o")
    assert [card["id"] for card in listed] == ["team/m", "m", "alias"]
    assert [a.json()["model"] for a in answers] == ["m", "team/m"]
    assert unnamed.json()["model"] == "team/m"
    assert retrieved.json()["id"] == "alias"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
