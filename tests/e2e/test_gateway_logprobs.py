"""The gateway's log probabilities, token endpoints and SGLang's /generate against the real stack:
`stepwise up --gateway-port 0` on the embedded model (127.0.0.1, ephemeral ports, always stopped),
spoken to with the official `openai` client and with the requests lm-eval-harness and
sglang.bench_serving send. Log probabilities are checked against the same request over gRPC."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clients.client import StepwiseClient, generate_request, sampling_params
from protos.stepwise.v1 import generation_pb2 as gen_pb
from stepwise.models import resolve_model
from stepwise.up import stop_processes
from tests.e2e.test_gateway import PROMPT, Up, grpc_greedy, start_up

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    proc = None
    try:
        proc, stack = start_up(tmp_path_factory.mktemp("gateway-logprobs"))
        yield stack
    finally:
        if proc is not None:
            stop_processes([proc])


def root(up: Up) -> str:
    return up.base_url.removesuffix("/v1")


def grpc_responses(up: Up, prompt: str | list[int], **sampling: Any) -> list[gen_pb.GenerateResponse]:
    """The raw response stream of one Generate call with these SamplingParams fields."""
    logprob_fields = {
        k: sampling.pop(k) for k in ("logprobs", "top_logprobs", "logprob_start_len") if k in sampling
    }

    async def run() -> list[gen_pb.GenerateResponse]:
        params = sampling_params(**sampling)
        for name, value in logprob_fields.items():
            setattr(params, name, value)
        async with StepwiseClient(up.address) as client:
            return [r async for r in client.stream(generate_request(prompt, params))]

    return asyncio.run(run())


def tokenize(up: Up, text: str) -> list[int]:
    reply = httpx.post(f"{root(up)}/tokenize", json={"prompt": text}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]  # type: ignore[no-any-return]


# --- no log probabilities needed from the backend ---------------------------------------------


def test_tokenize_detokenize_round_trip_and_version(up: Up) -> None:
    with httpx.Client(base_url=root(up), timeout=30) as http:
        reply = http.post("/tokenize", json={"model": "embedded", "prompt": PROMPT}).json()
        assert reply["count"] == len(reply["tokens"]) > 0 and reply["max_model_len"] > 0
        assert http.post("/detokenize", json={"tokens": reply["tokens"]}).json()["prompt"].endswith(PROMPT)
        # The count is the control plane's own: the prompt tokens of the same text.
        usage = up.openai().completions.create(model="embedded", prompt=PROMPT, max_tokens=1).usage
        assert usage is not None and usage.prompt_tokens == reply["count"]
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["count"] > reply["count"] // 2
        assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400

        async def version() -> str:
            async with StepwiseClient(up.address) as client:
                return (await client.server_info()).version

        assert http.get("/version").json() == {"version": asyncio.run(version())}


def bench_serving_request(prompt: str, output_len: int, stream: bool) -> dict[str, Any]:
    """What `python -m sglang.bench_serving --backend sglang` posts to /generate by default
    (async_request_sglang_generate: ignore_eos on, no LoRA, return_logprob off)."""
    return {
        "text": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": stream,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
    }


def test_sglang_generate_with_bench_servings_request(up: Up) -> None:
    expected = grpc_greedy(up, PROMPT, 12)
    with httpx.Client(base_url=root(up), timeout=60) as http:
        whole = http.post("/generate", json=bench_serving_request(PROMPT, 12, stream=False))
        assert whole.status_code == 200, whole.text
        body = whole.json()
        meta = body["meta_info"]
        assert meta["completion_tokens"] == len(body["output_ids"]) == 12
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["prompt_tokens"] == len(tokenize(up, PROMPT)) and "cached_tokens" in meta
        # ignore_eos: the greedy text up to where gRPC stopped at EOS is the same.
        assert body["text"].startswith(expected)
        with http.stream("POST", "/generate", json=bench_serving_request(PROMPT, 12, stream=True)) as reply:
            assert reply.status_code == 200
            lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    # As bench_serving reads them: the last event's text is the whole text, completion_tokens grows.
    assert events[-1]["text"] == body["text"] and events[-1]["output_ids"] == body["output_ids"]
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 12


def test_a_model_from_the_hub_cache_is_served_under_its_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model acme/tiny@main` from the Hugging Face cache: /v1/models and retrieve say `acme/tiny`."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(resolve_model("embedded"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    proc = None
    try:
        proc, stack = start_up(tmp_path, "--model", "acme/tiny@main")
        client = stack.openai()
        assert [m.id for m in client.models.list().data] == ["acme/tiny"]
        assert client.models.retrieve("acme/tiny").id == "acme/tiny"
        reply = client.completions.create(model="acme/tiny", prompt=PROMPT, max_tokens=2)
        assert reply.model == "acme/tiny"
        # gRPC says the same name, not the snapshot's commit (the path is for callers with a key).
        info = asyncio.run(_server_info(stack.address))
        assert (info.model, info.model_path) == ("acme/tiny", "")
    finally:
        if proc is not None:
            stop_processes([proc])


async def _server_info(address: str) -> gen_pb.ServerInfo:
    async with StepwiseClient(address) as client:
        return await client.server_info()


def test_up_passes_the_served_model_name_to_its_gateway(tmp_path: Path) -> None:
    proc = None
    try:
        proc, stack = start_up(tmp_path, "--gateway-served-model-name", "team/story-model", "story")
        client = stack.openai()
        assert [m.id for m in client.models.list().data] == ["team/story-model", "story"]
        for name in ("team/story-model", "story"):
            assert client.completions.create(model=name, prompt=PROMPT, max_tokens=1).model == name
        # A model the gateway does not serve: vLLM's 404, never another model's answer.
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=1)
        assert caught.value.code == "model_not_found"
        # The control plane reports the name the gateway reports.
        assert asyncio.run(_server_info(stack.address)).model == "team/story-model"
    finally:
        if proc is not None:
            stop_processes([proc])


# --- log probabilities from the backend -------------------------------------------------------


def test_lm_eval_loglikelihood_request_equals_grpc_prompt_logprobs(up: Up) -> None:
    """lm-eval-harness's exact request on a token-id prompt: token_logprobs are [null, the prompt's
    own log probabilities..., the generated token's], the numbers gRPC's PromptLogprobs gives."""
    ids = tokenize(up, PROMPT + " there was")
    responses = grpc_responses(
        up, ids, max_new_tokens=1, temperature=0.0, logprobs=True, top_logprobs=1, logprob_start_len=0
    )
    prompt = next(r.prompt_logprobs for r in responses if r.WhichOneof("event") == "prompt_logprobs")
    chunks = [r.chunk for r in responses if r.WhichOneof("event") == "chunk"]
    generated = [lp for c in chunks for lp in c.logprobs]
    assert prompt.start == 0 and len(prompt.positions) == len(ids) and len(generated) == 1
    expected = [None] + [p.logprob for p in prompt.positions[1:]] + [generated[0].logprob]

    reply = up.openai().completions.create(
        model="embedded", prompt=[ids], max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs == expected
    assert choice.logprobs.tokens == [p.token for p in prompt.positions] + [generated[0].token]
    tops = choice.logprobs.top_logprobs
    assert tops is not None and tops[0] is None and all(len(t) == 1 for t in tops[1:])
    assert choice.text == prompt.text + chunks[0].text
    # lm-eval's is_greedy: at temperature 0 the generated token is the most likely one.
    assert max(tops[-1].items(), key=lambda kv: kv[1])[0] == choice.logprobs.tokens[-1]
    # Streamed: the echo and the prompt's positions come with the first chunk, the same numbers.
    tokens: list[str] = []
    streamed: list[float | None] = []
    text = ""
    for chunk in up.openai().completions.create(
        model="embedded", prompt=[ids], max_tokens=1, logprobs=1, echo=True, temperature=0, stream=True
    ):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                streamed += c.logprobs.token_logprobs or []
    assert (text, tokens, streamed) == (choice.text, choice.logprobs.tokens, expected)


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(up: Up) -> None:
    ids = tokenize(up, PROMPT)
    reply = httpx.post(
        f"{up.base_url}/completions",
        json={"prompt": ids, "max_tokens": 0, "logprobs": 0, "echo": True, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    logprobs = reply.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) and logprobs["token_logprobs"][0] is None
    assert reply.json()["usage"]["completion_tokens"] == 0


def test_four_prompts_two_samples_each_with_logprobs(up: Up) -> None:
    client = up.openai()
    prompts = ["Once upon a time", "The king said", "She", "In the forest"]
    batch = client.completions.create(
        model="embedded", prompt=prompts, n=2, max_tokens=5, temperature=0, logprobs=2
    )
    assert [c.index for c in batch.choices] == list(range(8))
    alone = [
        client.completions.create(model="embedded", prompt=p, max_tokens=5, temperature=0, logprobs=2)
        for p in prompts
    ]
    for c in batch.choices:
        same = alone[c.index // 2].choices[0]
        assert c.text == same.text and c.logprobs is not None and same.logprobs is not None
        assert c.logprobs.tokens == same.logprobs.tokens
        assert c.logprobs.token_logprobs == pytest.approx(same.logprobs.token_logprobs, abs=1e-4)
        assert c.logprobs.top_logprobs is not None and all(len(t) == 2 for t in c.logprobs.top_logprobs)
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    assert batch.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in batch.choices if c.logprobs)


def test_chat_top_logprobs(up: Up) -> None:
    client = up.openai()
    messages = [{"role": "user", "content": "Tell me about the sea"}]
    whole = client.chat.completions.create(
        model="embedded",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and whole.usage is not None and len(content) == whole.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    streamed = []
    for chunk in client.chat.completions.create(
        model="embedded",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [e.token for e in streamed] == [e.token for e in content]


def test_logprobs_past_the_servers_limit_are_a_400_naming_logprobs(up: Up) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        up.openai().completions.create(model="embedded", prompt=PROMPT, max_tokens=1, logprobs=1000)
    assert refused.value.param == "logprobs"  # type: ignore[attr-defined]


def test_sglang_generate_with_prompt_logprobs_in_sglangs_shape(up: Up) -> None:
    ids = tokenize(up, PROMPT)
    start = 1
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    reply = httpx.post(f"{root(up)}/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    meta = reply.json()["meta_info"]
    responses = grpc_responses(
        up, ids, max_new_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2, logprob_start_len=start
    )
    prompt = next(r.prompt_logprobs for r in responses if r.WhichOneof("event") == "prompt_logprobs")
    outputs = [lp for r in responses if r.WhichOneof("event") == "chunk" for lp in r.chunk.logprobs]
    assert meta["input_token_logprobs"] == [
        [p.logprob if p.HasField("logprob") else None, p.token_id, p.token] for p in prompt.positions
    ]
    assert (
        meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == len(ids) - start
    )
    assert meta["input_top_logprobs"][0] is None
    assert [e[1] for e in meta["output_token_logprobs"]] == [o.token_id for o in outputs]
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        [o.logprob for o in outputs], abs=1e-4
    )
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    # SGLang's default start (-1): the last prompt token only, no log probability there.
    default = httpx.post(f"{root(up)}/generate", json={**body, "logprob_start_len": -1}, timeout=60).json()
    assert [e[:2] for e in default["meta_info"]["input_token_logprobs"]] == [[None, ids[-1]]]
