"""SGLang's own client, `sgl.RuntimeEndpoint(url)` (python/sglang/lang/backend/runtime_endpoint.py),
spoken to with exactly the requests it sends: `GET /get_model_info` when it connects, then an
`sgl.gen` program's `/generate` (whole and streamed), `cache_prefix`'s zero-token generate,
`get_server_info`, and `Runtime`'s readiness probe `GET /health_generate`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gateway.fake import FakeControlPlane, app_with, http_client

pytestmark = pytest.mark.timeout(60)

PROGRAM_TEXT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def gen_body(text: str, max_new_tokens: int, stream: bool = False) -> dict[str, Any]:
    """RuntimeEndpoint.generate's body for `sgl.gen("answer", max_tokens=N)`: global_config's two
    detokenizer switches, then SglSamplingParams.to_srt_kwargs() at the program's defaults (the
    logprob fields are left out while None)."""
    body: dict[str, Any] = {
        "text": text,
        "sampling_params": {
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": None,
            "n": 1,
            "stop": [],
            "stop_token_ids": [],
            "stop_regex": None,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "ignore_eos": False,
            "regex": None,
            "json_schema": None,
        },
    }
    if stream:
        body["stream"] = True
    return body


async def test_runtime_endpoint_connects_and_runs_a_gen_program() -> None:
    plane = FakeControlPlane()
    async with http_client(app_with(plane, model_name="acme/tiny")) as client:
        info = await client.get("/get_model_info")
        assert info.status_code == 200, info.text
        # RuntimeEndpoint picks its chat template from model_path (get_chat_template_by_model_path).
        assert info.json()["model_path"] == "acme/tiny" and info.json()["is_generation"] is True

        cached = await client.post(
            "/generate", json={"text": PROGRAM_TEXT, "sampling_params": {"max_new_tokens": 0}}
        )
        assert cached.status_code == 200 and cached.json()["meta_info"]["completion_tokens"] == 0

        whole = await client.post("/generate", json=gen_body(PROGRAM_TEXT, 4))
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        assert len(answer["text"]) == 4 and answer["meta_info"]["finish_reason"]["type"] == "length"

        streamed = await client.post("/generate", json=gen_body(PROGRAM_TEXT, 4, stream=True))
        assert streamed.status_code == 200, streamed.text
        # generate_stream: each `data:` line's text is the whole text so far; it takes the new end.
        pos, pieces = 0, []
        for line in streamed.text.splitlines():
            if line.startswith("data:") and line != "data: [DONE]":
                data = json.loads(line[5:])
                pieces.append(data["text"][pos:])
                pos += len(pieces[-1])
                assert "meta_info" in data
        assert "".join(pieces) == answer["text"]

        server = await client.get("/get_server_info")
        assert server.status_code == 200
        assert server.json()["served_model_name"] == "acme/tiny" and server.json()["context_length"] == 512
        assert server.json()["version"] == "9.9.9"


async def test_health_generate_generates_one_token() -> None:
    plane = FakeControlPlane()
    async with http_client(app_with(plane)) as client:
        healthy = await client.get("/health_generate")
        plane.refuse_with = "sampling: no worker"
        sick = await client.get("/health_generate")
    assert healthy.status_code == 200
    assert plane.requests[0].sampling.max_new_tokens == 1
    assert sick.status_code == 503


async def test_flush_cache_is_refused_by_name_not_pretended() -> None:
    """The gateway cannot empty a control plane's prefix cache: SGLang's client gets an error, not a
    200 for a flush that never happened."""
    async with http_client(app_with(FakeControlPlane())) as client:
        response = await client.post("/flush_cache", json={"empty_cache": True})
    assert response.status_code == 501 and "flush_cache" in response.json()["error"]["message"]
