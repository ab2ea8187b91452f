"""SGLang's native `/generate` in SGLang's shapes, from synthetic GenerateResponse streams (the real
app through ASGI, a fake control plane: tests/gateway/fake.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gateway.fake import BOS, FakeControlPlane, app_with, generated, http_client, logprob, piece

pytestmark = pytest.mark.timeout(60)


def bench_serving_request(prompt: str | list[int], output_len: int, stream: bool) -> dict[str, Any]:
    """The body `python -m sglang.bench_serving --backend sglang` posts (async_request_sglang_generate
    with its default flags: ignore_eos on, no LoRA, return_logprob off)."""
    return {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": stream,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
    }


def sse_events(body: str) -> list[Any]:
    lines = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture
def plane() -> FakeControlPlane:
    return FakeControlPlane()


@pytest.mark.parametrize("prompt", ["Once", [BOS, 40, 41, 42]], ids=["text", "input_ids"])
async def test_bench_serving_request_whole_and_streamed(
    plane: FakeControlPlane, prompt: str | list[int]
) -> None:
    ids = plane.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    expected = [generated(ids, 0, k) for k in range(5)]
    async with http_client(app_with(plane)) as http:
        reply = await http.post("/generate", json=bench_serving_request(prompt, 5, stream=False))
        assert reply.status_code == 200, reply.text
        whole = reply.json()
        assert plane.requests[-1].sampling.ignore_eos and plane.requests[-1].sampling.max_new_tokens == 5
        assert whole["text"] == "".join(piece(t) for t in expected) and whole["output_ids"] == expected
        meta = whole["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (len(ids), 5, 0)
        assert meta["id"] and "input_token_logprobs" not in meta and meta["e2e_latency"] == 0.5
        # Streamed: the text so far in each event (bench_serving keeps the last), then [DONE].
        reply = await http.post("/generate", json=bench_serving_request(prompt, 5, stream=True))
        events = sse_events(reply.text)
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert [e["meta_info"]["completion_tokens"] for e in events][:5] == [1, 2, 3, 4, 5]
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == expected
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert all("index" not in e for e in events)


async def test_return_logprob_from_a_start_with_top_logprobs_in_sglangs_shape(
    plane: FakeControlPlane,
) -> None:
    ids = [BOS, 40, 41, 42, 43, 44]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    async with http_client(app_with(plane)) as http:
        reply = await http.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    asked = plane.requests[-1].sampling
    assert asked.logprobs and asked.logprob_start_len == 2 and asked.top_logprobs == 2
    meta = reply.json()["meta_info"]
    inputs = meta["input_token_logprobs"]
    assert [entry[1:] for entry in inputs] == [[t, piece(t)] for t in ids[2:]]
    assert inputs[0][0] is None
    assert [entry[0] for entry in inputs[1:]] == pytest.approx(
        [logprob(i, ids[i]) for i in range(3, len(ids))]
    )
    assert meta["input_top_logprobs"][0] is None
    assert all(len(top) == 2 and all(len(e) == 3 for e in top) for top in meta["input_top_logprobs"][1:])
    outputs = meta["output_token_logprobs"]
    new = [generated(ids, 0, k) for k in range(3)]
    assert [entry[1] for entry in outputs] == new == reply.json()["output_ids"]
    assert [entry[0] for entry in outputs] == pytest.approx(
        [logprob(len(ids) + k, t) for k, t in enumerate(new)]
    )
    assert len(meta["output_top_logprobs"]) == 3
    assert "input_token_ids_logprobs" not in meta and "output_token_ids_logprobs" not in meta


async def test_default_start_scores_the_last_prompt_token_only(plane: FakeControlPlane) -> None:
    """SGLang's logprob_start_len -1 with return_logprob: the last prompt token, which carries no
    log probability; nothing extra is asked of the model."""
    body = {
        "text": "Hey",
        "sampling_params": {"max_new_tokens": 2},
        "return_logprob": True,
        "token_ids_logprob": [5, 7],
    }
    async with http_client(app_with(plane)) as http:
        reply = await http.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    assert not plane.requests[-1].sampling.HasField("logprob_start_len")
    assert list(plane.requests[-1].sampling.token_ids_logprob) == [5, 7]
    meta = reply.json()["meta_info"]
    assert meta["input_token_logprobs"] == [[None, ord("y") - 30, None]]
    assert meta["input_token_ids_logprobs"] == [None]
    for position, ids_logprobs in enumerate(meta["output_token_ids_logprobs"]):
        assert [e[1] for e in ids_logprobs] == [5, 7] and all(e[2] is None for e in ids_logprobs)
        assert [e[0] for e in ids_logprobs] == pytest.approx([logprob(4 + position, t) for t in (5, 7)])
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta
    async with http_client(app_with(plane, tokenizer=False)) as http:
        reply = await http.post("/generate", json=body)
        assert reply.status_code == 501 and reply.json()["error"]["param"] == "return_logprob"
        body_ids = {**body, "text": None, "input_ids": [BOS, 50]}
        assert (await http.post("/generate", json=body_ids)).json()["meta_info"]["input_token_logprobs"] == [
            [None, 50, None]
        ]


async def test_a_batch_with_n_samples_is_a_list_prompt_by_sample(plane: FakeControlPlane) -> None:
    body = {"text": ["ab", "cd"], "sampling_params": {"max_new_tokens": 2, "n": 2}, "rid": "job"}
    async with http_client(app_with(plane)) as http:
        whole = (await http.post("/generate", json=body)).json()
        streamed = sse_events((await http.post("/generate", json={**body, "stream": True})).text)
    assert [r["meta_info"]["id"] for r in whole] == ["job_0_0", "job_0_1", "job_1_0", "job_1_1"]
    for i, r in enumerate(whole):
        prompt, sample = divmod(i, 2)
        assert r["output_ids"] == [
            generated(plane.tokenizer.encode(["ab", "cd"][prompt]), sample, k) for k in range(2)
        ]
    last = {e["index"]: e for e in streamed}
    assert sorted(last) == [0, 1, 2, 3] and [last[i]["text"] for i in range(4)] == [r["text"] for r in whole]


async def test_a_stop_token_finish_names_it(plane: FakeControlPlane) -> None:
    ids = [BOS, 40]
    stop = generated(ids, 0, 1)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "stop_token_ids": [stop]}}
    async with http_client(app_with(plane)) as http:
        meta = (await http.post("/generate", json=body)).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop} and meta["completion_tokens"] == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # One constraint per request; a schema that is no JSON; a constraint with ignore_eos.
        ({"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= x"}}, "sampling_params.ebnf"),
        ({"text": "x", "sampling_params": {"json_schema": "{"}}, "sampling_params.json_schema"),
        (
            {"text": "x", "sampling_params": {"regex": "a", "ignore_eos": True}},
            "sampling_params.ignore_eos",
        ),
        ({"text": "x", "sampling_params": {"choices": ["a"]}}, "sampling_params.choices"),
        (
            {"text": "x", "sampling_params": {"skip_special_tokens": False}},
            "sampling_params.skip_special_tokens",
        ),
        ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
        ({"text": "x", "sampling_params": {"logit_bias": {"a": 1}}}, "sampling_params.logit_bias"),
        ({"text": "x", "top_logprobs_num": 2}, "top_logprobs_num"),
        ({"text": "x", "logprob_start_len": 0}, "logprob_start_len"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"text": "x", "lora_path": "adapter"}, "lora_path"),
        ({"text": "x", "input_ids": [1]}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [[1], [2**40]]}, "input_ids.1.0"),
        ({"text": "x", "sampling_params": {"sampling_seed": 2**64}}, "sampling_params.sampling_seed"),
        ({"text": ["a", "\ud800"]}, "text.1"),
        ({"text": ["a", "b"], "rid": ["only-one"]}, "rid"),
    ],
)
async def test_what_is_not_supported_is_a_400_naming_it(
    plane: FakeControlPlane, body: dict[str, Any], param: str
) -> None:
    async with http_client(app_with(plane)) as http:
        # As JSON escapes it (a lone surrogate included): httpx's own encoder refuses one.
        reply = await http.post(
            "/generate", content=json.dumps(body), headers={"content-type": "application/json"}
        )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
    assert reply.json()["error"]["message"].startswith(f"{param}:")
