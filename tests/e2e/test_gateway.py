"""The OpenAI-compatible gateway, spoken to with the official `openai` client, against
`stepwise up --gateway-port 0` on the embedded model (127.0.0.1, ephemeral ports, always stopped)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from clients.client import StepwiseClient
from gateway.chat import load_template
from stepwise.embedded import resolve_model
from stepwise.up import stop_processes

PROMPT = "Once upon a time"
UP_FLAGS = ["--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]


@dataclass(frozen=True, slots=True)
class Up:
    address: str  # gRPC client address
    base_url: str  # http://HOST:PORT/v1

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=30)


def start_up(tmp: Path, *flags: str) -> tuple[subprocess.Popen[bytes], Up]:
    """`stepwise up --gateway-port 0 --ready-file F`; the caller stops it."""
    ready = tmp / "up.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stepwise.cli",
            "up",
            *UP_FLAGS,
            "--gateway-port",
            "0",
            "--ready-file",
            str(ready),
            *flags,
        ],
        env={**os.environ},
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_processes([proc])
            raise AssertionError(f"stepwise up did not start (exit code {proc.returncode})")
        time.sleep(0.05)
    data = json.loads(ready.read_text())
    return proc, Up(data["address"], f"http://{data['gateway_address']}/v1")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    proc, stack = None, None
    try:
        proc, stack = start_up(tmp_path_factory.mktemp("gateway"))
        yield stack
    finally:
        if proc is not None:
            stop_processes([proc])


def grpc_greedy(up: Up, prompt: str, max_tokens: int) -> str:
    async def run() -> str:
        async with StepwiseClient(up.address) as client:
            gen = await client.generate(prompt, max_new_tokens=max_tokens, temperature=0.0)
            return gen.text

    return asyncio.run(run())


def chat_prompt(messages: list[dict[str, str]]) -> str:
    template = load_template(resolve_model("embedded"))
    assert template is not None
    return template.render(messages)


@pytest.mark.timeout(120)
def test_completions_greedy_equals_grpc_streaming_or_not(up: Up) -> None:
    client = up.openai()
    expected = grpc_greedy(up, PROMPT, 16)
    whole = client.completions.create(model="embedded", prompt=PROMPT, max_tokens=16, temperature=0)
    assert whole.choices[0].text == expected and expected
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.completion_tokens <= 16 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    stream = client.completions.create(
        model="embedded",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    # The second time the prompt is in the radix cache.
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None and details.cached_tokens > 0


@pytest.mark.timeout(120)
def test_token_id_prompt(up: Up) -> None:
    whole = up.openai().completions.create(model="embedded", prompt=[0, 1, 2, 3], max_tokens=4, temperature=0)
    assert whole.usage is not None and whole.usage.prompt_tokens == 4


@pytest.mark.timeout(120)
def test_chat_greedy_equals_grpc_on_the_rendered_prompt(up: Up) -> None:
    client = up.openai()
    messages = [{"role": "user", "content": "Tell me about the sea"}]
    expected = grpc_greedy(up, chat_prompt(messages), 12)
    whole = client.chat.completions.create(
        model="embedded",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
    )
    assert whole.choices[0].message.content == expected and expected
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="embedded",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


@pytest.mark.timeout(120)
def test_n_samples_seed_and_stop_strings(up: Up) -> None:
    client = up.openai()
    whole = client.completions.create(
        model="embedded", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7, n=2
    )
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage is not None
    assert whole.usage.completion_tokens > 0
    again = client.completions.create(
        model="embedded", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7, n=2
    )
    assert [c.text for c in again.choices] == [c.text for c in whole.choices]
    streamed = client.chat.completions.create(
        model="embedded",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        n=2,
        stream=True,
    )
    indices = {c.choices[0].index for c in streamed if c.choices}
    assert indices == {0, 1}
    # A stop string taken from the greedy output: the text ends before it, finish_reason "stop".
    greedy = grpc_greedy(up, PROMPT, 16)
    stop = greedy[len(greedy) // 2 :][:3]
    cut = client.completions.create(
        model="embedded", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == greedy[: greedy.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


BAD_REQUESTS = [
    ("completions", {"model": "embedded", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("completions", {"model": "embedded", "prompt": "x", "temperature": -0.5}, "temperature"),
    ("completions", {"model": "embedded", "prompt": "x", "logprobs": 2}, "logprobs"),
    # Refused by the control plane (INVALID_ARGUMENT), named as the OpenAI field.
    ("completions", {"model": "embedded", "prompt": "x", "stop": [f"s{i}" for i in range(70)]}, "stop"),
    ("chat/completions", {"model": "embedded", "messages": [{"role": "wizard", "content": "x"}]}, None),
    ("chat/completions", {"model": "embedded", "messages": []}, "messages"),
]


@pytest.mark.timeout(120)
def test_bad_requests_are_400_in_openai_shape_and_the_gateway_keeps_serving(up: Up) -> None:
    with httpx.Client(base_url=up.base_url, timeout=30) as http:
        for path, body, param in BAD_REQUESTS:
            reply = http.post(f"/{path}", json=body)
            assert reply.status_code == 400, (body, reply.text)
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error"
            if param is not None:
                assert error["param"] == param and param in error["message"], error
        malformed = http.post(
            "/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}
        )
        assert malformed.status_code == 400 and "JSON" in malformed.json()["error"]["message"]
        no_model = http.post("/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert no_model.status_code == 200
        assert http.get("/models").json()["data"][0]["id"] == "embedded"
        assert http.get(up.base_url.removesuffix("/v1") + "/health").status_code == 200
        metrics = http.get(up.base_url.removesuffix("/v1") + "/metrics").text
        assert 'stepwise_gateway_requests_total{endpoint="completions",status="400"}' in metrics
    with pytest.raises(openai.BadRequestError):
        up.openai().completions.create(model="embedded", prompt=PROMPT, max_tokens=-1)


INT32_PAST = 2**31
LONE = '"\\ud800"'  # a lone surrogate, as JSON escapes it: valid JSON, but no UTF-8 string
CHAT = '"messages": [{"role": "user", "content": "hi"}]'


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (path, JSON body as text, the param the 400 must name). Each got a plain-text 500 before: the
# protocol's int32/uint64 fields refused the value, UTF-8 encoding refused the surrogate, or the
# JSON decoder ran out of recursion.
OUT_OF_RANGE = [
    ("completions", f'{{"prompt": "x", "max_tokens": {INT32_PAST}}}', "max_tokens"),
    ("completions", f'{{"prompt": "x", "max_tokens": {2**64}}}', "max_tokens"),
    ("completions", f'{{"prompt": "x", "top_k": {INT32_PAST}}}', "top_k"),
    ("completions", f'{{"prompt": "x", "min_tokens": {2**40}}}', "min_tokens"),
    ("completions", f'{{"prompt": "x", "n": {2**40}}}', "n"),
    ("completions", f'{{"prompt": "x", "priority": {INT32_PAST}}}', "priority"),
    ("completions", f'{{"prompt": "x", "priority": {-INT32_PAST - 1}}}', "priority"),
    ("completions", f'{{"prompt": "x", "seed": {2**64}}}', "seed"),
    ("completions", f'{{"prompt": "x", "seed": {10**30}}}', "seed"),
    ("completions", f'{{"prompt": "x", "stop_token_ids": [1, {2**40}]}}', "stop_token_ids.1"),
    ("completions", f'{{"prompt": "x", "stop_token_ids": [{-INT32_PAST - 1}]}}', "stop_token_ids.0"),
    ("completions", f'{{"prompt": [{2**40}]}}', "prompt.0"),
    ("completions", f'{{"prompt": [1, {2**64}]}}', "prompt.1"),
    ("completions", f'{{"prompt": [[{INT32_PAST}]]}}', "prompt.0.0"),
    ("chat/completions", f'{{{CHAT}, "max_completion_tokens": {INT32_PAST}}}', "max_completion_tokens"),
    ("chat/completions", f'{{{CHAT}, "max_tokens": {2**64}}}', "max_tokens"),
    ("chat/completions", f'{{{CHAT}, "n": {2**40}}}', "n"),
    ("chat/completions", f'{{{CHAT}, "seed": {2**64}}}', "seed"),
]
SURROGATES = [
    ("completions", f'{{"prompt": {LONE}}}', "prompt"),
    ("completions", f'{{"prompt": ["a{LONE[1:]}]}}', "prompt.0"),
    ("completions", f'{{"prompt": "x", "stop": {LONE}}}', "stop"),
    ("completions", f'{{"prompt": "x", "stop": ["ok", {LONE}]}}', "stop.1"),
    ("completions", f'{{"prompt": "x", "user": {LONE}}}', "user"),
    ("completions", f'{{"prompt": "x", "model": {LONE}}}', "model"),
    ("chat/completions", f'{{"messages": [{{"role": "user", "content": {LONE}}}]}}', "messages.0.content"),
    (
        "chat/completions",
        f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": {LONE}}}]}}]}}',
        "messages.0.content.0.text",
    ),
    ("chat/completions", f'{{{CHAT}, "model": {LONE}}}', "model"),
    ("chat/completions", f'{{{CHAT}, "stop": [{LONE}]}}', "stop.0"),
]
# No field to name: the decoder gives up before there are fields.
DEEP = [
    ("completions", f'{{"prompt": "x", "extra": {_nested(1000)}}}', None),
    ("completions", f'{{"prompt": {_nested(5000)}}}', None),
    ("completions", f'{{"prompt": "x", "extra": {_nested(100_000)}}}', None),
    (
        "chat/completions",
        f'{{"messages": [{{"role": "user", "content": "hi", "x": {_nested(1000)}}}]}}',
        None,
    ),
    ("completions", f'{{"prompt": "x", "max_tokens": {"9" * 5000}}}', None),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("path", "body", "param"),
    OUT_OF_RANGE + SURROGATES + DEEP,
    ids=[f"{p}:{param or body[:40]}" for p, body, param in OUT_OF_RANGE + SURROGATES + DEEP],
)
def test_absurd_values_are_a_400_naming_the_field(up: Up, path: str, body: str, param: str | None) -> None:
    with httpx.Client(base_url=up.base_url, timeout=30) as http:
        reply = http.post(f"/{path}", content=body.encode(), headers={"content-type": "application/json"})
        assert reply.status_code == 400, reply.text[:300]
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["param"] == param, error
        if param is not None:
            assert error["message"].startswith(f"{param}:"), error
        assert http.post("/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


# Each was a 500 ("Invalid metadata"): gRPC metadata carries printable ASCII only.
BAD_KEYS = [b"Bearer k\xc3\xa9y", b"Bearer k\xe9y", b"Bearer a\tb", b"Bearer a\x01b", b"Bearer \x7fkey"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("authorization", BAD_KEYS, ids=repr)
def test_a_key_no_control_plane_can_hold_is_a_401(up: Up, authorization: bytes) -> None:
    with httpx.Client(base_url=up.base_url, timeout=30) as http:
        for reply in (
            http.post(
                "/completions",
                json={"prompt": PROMPT, "max_tokens": 2},
                headers={"authorization": authorization},
            ),
            http.get("/models", headers={"authorization": authorization}),
        ):
            assert reply.status_code == 401, reply.text[:300]
            error = reply.json()["error"]
            assert error["type"] == "authentication_error" and "Authorization" in error["message"], error


@pytest.mark.timeout(120)
def test_disconnecting_a_stream_aborts_the_request_and_frees_its_kv(up: Up) -> None:
    body = {"model": "embedded", "prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=up.base_url, timeout=30) as http,
        http.stream("POST", "/completions", json=body) as reply,
    ):
        assert reply.status_code == 200
        lines = reply.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")) >= 3

    async def freed() -> None:
        async with StepwiseClient(up.address) as client:
            deadline = time.monotonic() + 15
            while True:
                info = await client.server_info()
                if info.running == 0 and all(w.book_live_seqs == 0 for w in info.workers):
                    return
                assert time.monotonic() < deadline, f"request still running: {info}"
                await asyncio.sleep(0.1)

    asyncio.run(freed())


@pytest.mark.timeout(180)
def test_bearer_key_is_forwarded_to_the_control_plane(tmp_path: Path) -> None:
    proc = None
    try:
        proc, stack = start_up(tmp_path, "--api-key", "sesame")
        with pytest.raises(openai.AuthenticationError):
            stack.openai("wrong").completions.create(model="embedded", prompt=PROMPT, max_tokens=2)
        reply = stack.openai("sesame").completions.create(model="embedded", prompt=PROMPT, max_tokens=2)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert httpx.get(stack.base_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
    finally:
        if proc is not None:
            stop_processes([proc])
