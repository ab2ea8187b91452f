"""A constrained output whose grammar could not be satisfied (FINISH_REASON_GRAMMAR_UNSATISFIABLE,
issue 37 item 7) reaches HTTP clients as `grammar_unsatisfiable`, never as `stop`: OpenAI's
completions (whole and streamed, and through the openai client), and SGLang's /generate."""

from __future__ import annotations

import json

import pytest

from protos.stepwise.v1 import generation_pb2 as gen_pb
from tests.gateway.fake import FakeControlPlane, app_with, http_client, openai_client

pytestmark = pytest.mark.timeout(30)

WHY = "the grammar could not be satisfied: no token could follow the output"


def _plane() -> FakeControlPlane:
    return FakeControlPlane(
        reply=lambda _request: "ab", scripted_finish=(gen_pb.FINISH_REASON_GRAMMAR_UNSATISFIABLE, WHY)
    )


def _events(text: str) -> list[dict[str, object]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_openai_completions_say_grammar_unsatisfiable() -> None:
    app = app_with(_plane())
    body = {"model": "fake", "prompt": "hi", "max_tokens": 8}
    async with http_client(app) as http:
        whole = await http.post("/v1/completions", json=body)
        streamed = await http.post("/v1/completions", json={**body, "stream": True})
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["finish_reason"] == "grammar_unsatisfiable"
    finishes = [c["finish_reason"] for e in _events(streamed.text) for c in e["choices"]]  # type: ignore[attr-defined]
    assert finishes[-1] == "grammar_unsatisfiable" and "stop" not in finishes


async def test_the_openai_client_reads_grammar_unsatisfiable() -> None:
    client = openai_client(app_with(_plane()))
    answer = await client.completions.create(model="fake", prompt="hi", max_tokens=8)
    assert answer.choices[0].finish_reason == "grammar_unsatisfiable"
    assert answer.choices[0].text == "ab"


async def test_sglang_generate_says_grammar_unsatisfiable_with_why() -> None:
    async with http_client(app_with(_plane())) as http:
        reply = await http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 8}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["meta_info"]["finish_reason"] == {"type": "grammar_unsatisfiable", "message": WHY}
