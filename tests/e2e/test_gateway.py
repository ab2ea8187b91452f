"""The OpenAI-compatible gateway, spoken to with the official `openai` client, against
`stepwise up --gateway-port 0` on the embedded model (127.0.0.1, ephemeral ports, always stopped)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from clients.client import Generation, StepwiseClient
from gateway.chat import load_template
from stepwise.models import resolve_model
from stepwise.up import stop_processes
from tests.processes import ready_file_sync

PROMPT = "Once upon a time"
UP_FLAGS = ["--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]


@dataclass(frozen=True, slots=True)
class Up:
    address: str  # gRPC client address
    base_url: str  # http://HOST:PORT/v1

    def openai(self, api_key: str = "unused", timeout: float = 30) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=timeout)


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
def test_a_batch_of_prompts_is_one_call_each_with_choices_numbered_prompt_by_sample(up: Up) -> None:
    client = up.openai()
    prompts = ["Once upon a time", "The king said", "She"]
    alone = [
        client.completions.create(model="embedded", prompt=p, max_tokens=6, temperature=0) for p in prompts
    ]
    batch = client.completions.create(model="embedded", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone if a.usage)
    ids = [[0, 1, 2, 3], [4, 5, 6]]
    by_ids = client.completions.create(model="embedded", prompt=ids, max_tokens=3, temperature=0)
    assert len(by_ids.choices) == 2 and by_ids.usage is not None and by_ids.usage.prompt_tokens == 7
    stream = client.completions.create(
        model="embedded",
        prompt=prompts,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [a.choices[0].text for a in alone] and None not in reasons
    # One refused prompt refuses the whole request.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="embedded", prompt=[[1, 2], [10**6]], max_tokens=2)


@pytest.mark.timeout(120)
def test_logit_bias_reaches_the_sampler_as_over_grpc(up: Up) -> None:
    async def grpc_run(bias: dict[int, float] | None) -> Generation:
        async with StepwiseClient(up.address) as client:
            return await client.generate(
                PROMPT, max_new_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=bias
            )

    free = asyncio.run(grpc_run(None))
    biased = asyncio.run(grpc_run({free.token_ids[0]: -100.0}))
    assert biased.token_ids[0] != free.token_ids[0]
    reply = up.openai().completions.create(
        model="embedded",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logit_bias={str(free.token_ids[0]): -100},
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].text == biased.text != free.text


@pytest.mark.timeout(120)
def test_models_retrieve_and_the_developer_role(up: Up) -> None:
    client = up.openai()
    card = client.models.retrieve("embedded")
    assert card.id == "embedded" and card.object == "model"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("another-model")
    # The embedded template knows no `developer` role: it is rendered as `system`.
    as_system = chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    whole = client.chat.completions.create(
        model="embedded",
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
    )
    assert whole.choices[0].message.content == grpc_greedy(up, as_system, 6)


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
    ("completions", {"model": "embedded", "prompt": "x", "logprobs": -1}, "logprobs"),
    # Refused by the control plane (INVALID_ARGUMENT), named as the OpenAI field.
    ("completions", {"model": "embedded", "prompt": "x", "stop": [f"s{i}" for i in range(70)]}, "stop"),
    ("chat/completions", {"model": "embedded", "messages": [{"role": "wizard", "content": "x"}]}, None),
    ("chat/completions", {"model": "embedded", "messages": []}, "messages"),
    # Asked for and not implemented: refused by name, never a 200 that ignores it.
    ("completions", {"model": "embedded", "prompt": "x", "logit_bias": {"99999": 10}}, "logit_bias"),
    ("completions", {"model": "embedded", "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"model": "embedded", "prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        "tools.0.function",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
        "response_format.json_schema",
    ),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        },
        "stream_options.continuous_usage_stats",
    ),
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
# Nesting is measured before the body is decoded, and the field that holds it is named (a body's
# own nesting past its bound is a 400 naming its top-level field: gateway/schemas.py, grammars/nesting.py).
DEEP = [
    ("completions", f'{{"prompt": "x", "extra": {_nested(1000)}}}', "extra"),
    ("completions", f'{{"prompt": {_nested(5000)}}}', "prompt"),
    ("completions", f'{{"prompt": "x", "extra": {_nested(100_000)}}}', "extra"),
    (
        "chat/completions",
        f'{{"messages": [{{"role": "user", "content": "hi", "x": {_nested(1000)}}}]}}',
        "messages",
    ),
    # No field to name: the number's digits are past what a decoder takes.
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


# --- a gateway of its own, in front of the module's stack: its memory, files and log are its own ---


@dataclass(frozen=True, slots=True)
class LoneGateway:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def peak_rss_mib(self) -> float:
        """The process's high-water resident memory (VmHWM), in MiB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


@contextlib.contextmanager
def lone_gateway(up: Up, tmp: Path, *flags: str, open_files: int | None = None) -> Iterator[LoneGateway]:
    """`stepwise gateway` against `up`'s control plane, its log in a file; `open_files`: its
    RLIMIT_NOFILE, soft and hard (as `ulimit -n` sets them). Always stopped."""
    ready, log = tmp / "gateway.json", tmp / "gateway.log"

    def limit_files() -> None:
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    args = ["gateway", "--control", up.address, "--port", "0", "--ready-file", str(ready), *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepwise.cli", *args], stdout=out, stderr=out, preexec_fn=limit_files
        )
    try:
        yield LoneGateway(proc, ready_file_sync(ready, proc, 60, "the gateway", log=log)["port"], log)
    finally:
        stop_processes([proc])


def good_request(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)


def assert_openai_error(reply: httpx.Response, status: int) -> dict[str, object]:
    assert reply.status_code == status, reply.text[:300]
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error  # type: ignore[no-any-return]


HUNDRED_MB = 100 * 1024 * 1024
JSON_HEADERS = {"content-type": "application/json"}


def _in_chunks(data: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    """A body of unknown length: httpx sends it chunked, with no Content-Length."""
    view = memoryview(data)
    for start in range(0, len(data), size):
        yield bytes(view[start : start + size])


@pytest.mark.timeout(240)
def test_bodies_past_the_limit_are_a_413_before_they_are_read_whole(up: Up, tmp_path: Path) -> None:
    """Two concurrent 100 MB bodies, one with its Content-Length and one chunked without, peaked at
    536 MiB (the shipped pod's limit is 512Mi): each is now refused with the default limit while a
    few MiB of it are in, and a Content-Length that promises more than is sent is refused on the
    header alone."""
    body = b'{"prompt": "' + b"x" * HUNDRED_MB + b'"}'
    with lone_gateway(up, tmp_path) as gateway:
        assert good_request(gateway.url).status_code == 200
        before = gateway.peak_rss_mib()

        def send(chunked: bool) -> httpx.Response:
            content = _in_chunks(body) if chunked else body
            with httpx.Client(base_url=gateway.url, timeout=120) as http:
                return http.post("/v1/completions", content=content, headers=JSON_HEADERS)

        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(send, [False, True]))
        for reply in replies:
            assert "--max-body-bytes" in str(assert_openai_error(reply, 413)["message"])
        with gateway.connect() as sock:
            head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {10 * HUNDRED_MB}\r\n\r\n"
            sock.sendall(head.encode() + b'{"prompt": "')
            assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")
        grown = gateway.peak_rss_mib() - before
        assert grown < 64, f"the gateway's peak memory grew {grown:.0f} MiB"
        assert good_request(gateway.url).status_code == 200


@pytest.fixture
def many_open_files() -> Iterator[None]:
    """This process may open 1,400 files (the attack below holds 1,100 sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 1400
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs {need} open files; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


HALF_A_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


def _served_despite_the_attack(gateway: LoneGateway, within_s: float) -> None:
    """A good request is answered 200 within `within_s`; until then every answer is a clean,
    OpenAI-shaped 503 (the gateway at its connection limit), never a hang or a reset."""
    deadline = time.monotonic() + within_s
    while True:
        reply = httpx.post(
            f"{gateway.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=5
        )
        if reply.status_code == 200:
            return
        assert_openai_error(reply, 503)
        assert time.monotonic() < deadline, "no good request was served"
        time.sleep(0.2)  # a client's pause before it retries


@pytest.mark.timeout(180)
def test_half_sent_requests_are_cut_off_and_cannot_starve_the_gateway(
    up: Up, tmp_path: Path, many_open_files: None
) -> None:
    """Under `ulimit -n 1024`, 1,100 connections that send half a request head each blocked all
    service, and asyncio logged a traceback per failed accept (167 MB in 25 s). With the default
    flags: the gateway serves again once the head deadline (10 s) cuts them off, answers a clean 503
    while it is full, and logs the accept errors once per interval."""
    with lone_gateway(up, tmp_path, "--log-level", "info", open_files=1024) as gateway:
        with contextlib.ExitStack() as held:
            attack = [held.enter_context(gateway.connect()) for _ in range(1100)]
            for sock in attack:
                sock.sendall(HALF_A_HEAD)
            _served_despite_the_attack(gateway, within_s=30)
            for sock in attack:
                # Cut off: closed (b""), perhaps after a 503 for those past the connection limit.
                sock.settimeout(15)
                try:
                    answer = sock.recv(4096)
                except ConnectionResetError:
                    answer = b""
                assert answer == b"" or answer.startswith(b"HTTP/1.1 503 "), answer[:100]
        assert gateway.log.stat().st_size < 64 * 1024, gateway.log.read_text()[-3000:]
        assert good_request(gateway.url).status_code == 200


def _answer_before_close(sock: socket.socket, trickle: bytes, within_s: float) -> bytes:
    """Send `trickle` a byte every 0.2 s until the gateway closes the connection; what it answered.
    Fails when it is still open after `within_s`."""
    deadline = time.monotonic() + within_s
    sock.settimeout(0.2)
    answer = b""
    for byte in (trickle[i : i + 1] for i in range(len(trickle))):
        assert time.monotonic() < deadline, f"still open after {within_s} s; answered {answer!r}"
        try:
            sock.sendall(byte)
            while chunk := sock.recv(4096):
                answer += chunk
            return answer
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return answer
    raise AssertionError("the trickle ran out before the gateway closed the connection")


@pytest.mark.timeout(120)
def test_a_head_or_body_trickled_in_is_cut_off_at_its_deadline(up: Up, tmp_path: Path) -> None:
    """The deadlines are for the whole head and the whole body, not for the gap between bytes: a
    byte every 0.2 s does not keep a request alive."""
    flags = ("--header-timeout", "1", "--body-timeout", "1")
    with lone_gateway(up, tmp_path, *flags) as gateway:
        with gateway.connect() as idle:
            idle.settimeout(10)
            assert idle.recv(4096) == b""  # a connection that sends nothing is closed
        with gateway.connect() as head:
            assert _answer_before_close(head, b"POST /v1/completions HTTP/1.1\r\n" + b"x" * 100, 4) == b""
        with gateway.connect() as body:
            body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")
            answer = _answer_before_close(body, b'{"prompt": "' + b"x" * 100, 4)
            status, _, rest = answer.partition(b"\r\n")
            assert status.startswith(b"HTTP/1.1 408 "), answer[:300]
            error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
            assert "--body-timeout" in error["message"], error
        # A request that takes its time to be served is not cut off: the deadlines are for reading it.
        slow = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
        assert httpx.post(f"{gateway.url}/v1/completions", json=slow, timeout=60).status_code == 200


@pytest.mark.timeout(120)
def test_sglang_runtime_endpoint_requests_on_the_real_stack(up: Up) -> None:
    """sgl.RuntimeEndpoint's requests (tests/gateway/test_sglang_runtime.py has their exact shapes)
    on the embedded model: it connects, a gen program runs, Runtime's readiness probe passes."""
    from tests.gateway.test_sglang_runtime import gen_body

    base = up.base_url.removesuffix("/v1")
    with httpx.Client(base_url=base, timeout=30) as http:
        assert http.get("/get_model_info").json()["model_path"] == "embedded"
        assert http.get("/health_generate").status_code == 200
        answer = http.post("/generate", json=gen_body(PROMPT, 4)).json()
        assert answer["meta_info"]["completion_tokens"] <= 4 and answer["meta_info"]["prompt_tokens"] > 0
        assert http.get("/get_server_info").json()["context_length"] > 0
