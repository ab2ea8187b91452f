"""Fuzzing a live control plane (a real process, a sim worker) from both sides.

Clients: any GenerateRequest hypothesis can build, every field and absurd sizes included, and raw
bytes that are no request at all, must get a stream that ends properly or a clean status: never
UNKNOWN or INTERNAL, never a hang. Workers: any hello and any StepResult a rogue worker sends must
cost at most that worker. The gateway in front of it: any OpenAI body (every field of both request
schemas, absurd sizes, surrogates, deep nesting, wrong types) must get a 2xx or an OpenAI-shaped
4xx, never a 5xx. After each example a good request must still be served.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from clients.client import StepwiseClient
from data_plane.models.loader import model_fingerprint
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import worker_pb2 as wk_pb
from protos.worker import StepPlan
from stepwise.models import resolve_model
from stepwise.up import stop_processes
from tests.e2e.conftest import ControlProcess
from tests.e2e.rogue import RogueWorker, hello, honest_result, tokens_bytes
from tests.processes import ready_file_sync

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

CLEAN_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
}
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
FINGERPRINT = model_fingerprint(resolve_model("embedded"))
FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlProcess]:
    # Least-loaded routing: a tie in load goes to the rogue (see hellos()). Cache-aware routing would
    # send every round's prompt to the real worker, which caches it, and the rogue would get no plan.
    flags = ["--max-queued-requests", "64", "--routing-policy", "least-loaded"]
    # No request generates more than 16 tokens (SGLang's env knob clamps max_new_tokens): the gateway
    # fuzz's absurd max_tokens and n would otherwise run to the context's end, and a whole (not
    # streamed) answer comes only then.
    env = {"STEPWISE_MAX_NEW_TOKENS_LIMIT": "16"}
    control = ControlProcess(flags, tmp_path_factory.mktemp("fuzz"), env)
    try:
        asyncio.run(control.start())
        control.add_worker("real")
        asyncio.run(control.wait_workers(1))
        yield control
    finally:
        control.stop()


def _set_optional(msg: object, values: dict[str, object]) -> None:
    for name, value in values.items():
        if value is not None:
            setattr(msg, name, value)


@st.composite
def sampling(draw: st.DrawFn) -> gen_pb.SamplingParams:
    msg = gen_pb.SamplingParams(
        stop=draw(st.lists(st.text(max_size=8), max_size=4) | st.just(["x"] * draw(st.integers(0, 3000)))),
        stop_token_ids=draw(st.lists(INT32, max_size=4) | st.just(list(range(draw(st.integers(0, 3000)))))),
        ignore_eos=draw(st.booleans()),
    )
    _set_optional(
        msg,
        {
            "max_new_tokens": draw(st.none() | st.integers(-5, 12) | INT32),
            "temperature": draw(st.none() | FLOATS),
            "top_p": draw(st.none() | FLOATS),
            "top_k": draw(st.none() | INT32),
            "min_p": draw(st.none() | FLOATS),
            "repetition_penalty": draw(st.none() | FLOATS),
            "frequency_penalty": draw(st.none() | FLOATS),
            "presence_penalty": draw(st.none() | FLOATS),
            "seed": draw(st.none() | st.integers(0, 2**64 - 1)),
            "n": draw(st.none() | st.integers(-3, 4) | INT32),
        },
    )
    return msg


@st.composite
def generate_requests(draw: st.DrawFn) -> gen_pb.GenerateRequest:
    msg = gen_pb.GenerateRequest(
        request_id=draw(st.text(max_size=12) | st.just("r" * draw(st.integers(0, 1000)))),
        routing_key=draw(st.text(max_size=8)),
        sampling=draw(sampling()),
    )
    prompt = draw(st.sampled_from(["text", "ids", "huge-text", "huge-ids", "none"]))
    if prompt == "text":
        msg.text = draw(st.text(max_size=64))
    elif prompt == "ids":
        msg.input_ids.ids.extend(draw(st.lists(INT32 | st.integers(0, 1100), max_size=40)))
    elif prompt == "huge-text":
        msg.text = "Once upon a time " * draw(st.integers(1, 200_000))
    elif prompt == "huge-ids":
        msg.input_ids.ids.extend([5] * draw(st.integers(1, 500_000)))
    if draw(st.booleans()):
        msg.priority = draw(INT32)
    return msg


async def _call(address: str, request: gen_pb.GenerateRequest | bytes) -> None:
    """One call, read for a while: a proper stream or a clean refusal, never a hang."""
    raw = isinstance(request, bytes)
    async with grpc.aio.insecure_channel(address) as channel:
        method = channel.unary_stream(
            "/stepwise.v1.Generation/Generate",
            request_serializer=(lambda b: b) if raw else gen_pb.GenerateRequest.SerializeToString,
            response_deserializer=gen_pb.GenerateResponse.FromString,
        )
        call = method(request, timeout=20)
        finished = 0
        try:
            async for response in call:
                finished += response.WhichOneof("event") == "finished"
                if finished == 1:
                    break
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in CLEAN_REFUSALS, (exc.code(), exc.details())
            assert exc.details(), "a refusal must say why"
            return
        finally:
            call.cancel()


async def _good(address: str) -> None:
    async with StepwiseClient(address) as client:
        gen = await asyncio.wait_for(client.generate([5, 6, 7], max_new_tokens=3, ignore_eos=True), 20)
    assert (gen.finish_reason, gen.completion_tokens) == ("length", 3), gen.finish_message


@FUZZ
@given(requests=st.lists(generate_requests(), min_size=1, max_size=3))
def test_any_generate_request_gets_a_stream_or_a_clean_status(plane: ControlProcess, requests) -> None:  # type: ignore[no-untyped-def]
    async def batch() -> None:
        await asyncio.gather(*(_call(plane.address, r) for r in requests))
        await _good(plane.address)

    asyncio.run(batch())
    assert plane.control.poll() is None


@FUZZ
@given(data=st.binary(max_size=200))
def test_any_bytes_get_a_clean_status(plane: ControlProcess, data: bytes) -> None:
    from google.protobuf.message import DecodeError

    from control_plane.frontend.client_codec import describe_unparsable

    async def outcome() -> tuple[grpc.StatusCode, str, bool]:
        """(status, its details, whether a finished event came) of one Generate call carrying `data`."""
        async with grpc.aio.insecure_channel(plane.address) as channel:
            method = channel.unary_stream(
                "/stepwise.v1.Generation/Generate",
                request_serializer=lambda b: b,
                response_deserializer=gen_pb.GenerateResponse.FromString,
            )
            call = method(data, timeout=20)
            try:
                async for response in call:
                    if response.WhichOneof("event") == "finished":
                        return grpc.StatusCode.OK, "", True
                return await call.code(), await call.details() or "", False
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or "", False
            finally:
                call.cancel()

    async def one() -> tuple[grpc.StatusCode, str, bool]:
        got = await outcome()
        await _good(plane.address)
        return got

    code, details, finished = asyncio.run(one())
    try:
        gen_pb.GenerateRequest.FromString(data)
    except DecodeError:  # no request at all: refused as such, saying why, not gRPC's UNKNOWN
        event("unparsable")
        assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, describe_unparsable(data))
    else:  # some request: a stream that reaches its finish, or a refusal that says why
        event("finished" if finished else str(code))
        assert finished or (code in CLEAN_REFUSALS and details), (code, details)
    assert plane.control.poll() is None


BAD_HELLO_VALUES = {
    "worker_id": st.sampled_from(["", "a rogue!", "a" * 300]),
    "kv_capacity_tokens": st.sampled_from([0, -1, 10**7, 10**13]) | st.integers(-(2**63), 2**63 - 1),
    "page_size": st.sampled_from([4, 0, -4, 10**6]) | INT32,
    "max_context": st.sampled_from([0, -1, 2**31 - 1]) | INT32,
    "vocab_size": st.sampled_from([0, 5, 2**31 - 1]) | INT32,
    "eos_token_ids": st.lists(INT32, max_size=3),
    "host_pool_capacity_tokens": st.sampled_from([-1, 10**13]) | st.integers(-(2**63), 2**63 - 1),
    "protocol_version": st.sampled_from([0, 1, 3]),
    "dtype": st.text(max_size=3) | st.just("d" * 500),
}


@st.composite
def hellos(draw: st.DrawFn) -> wk_pb.Hello:
    """A plausible hello with zero to two fields replaced by something odd or absurd."""
    # Sorts first: a tie in load sends the next request to the rogue, not the real worker. With the
    # real worker's fingerprint, or the control plane refuses it for serving another model.
    fields: dict[str, object] = {"worker_id": "a-rogue", "model_fingerprint": FINGERPRINT}
    for name in draw(st.lists(st.sampled_from(sorted(BAD_HELLO_VALUES)), max_size=2, unique=True)):
        fields[name] = draw(BAD_HELLO_VALUES[name])
    return hello(**fields)


ANSWERS = ("honest", "mangled", "garbage", "empty", "hello-again")
VALUES = st.lists(st.integers(0, 2**64 - 1) | st.integers(-(2**31), 2**31 - 1), max_size=6)


async def _rogue_round(
    plane: ControlProcess, greeting: wk_pb.Hello, answer: tuple[str, list[object]]
) -> None:
    async with StepwiseClient(plane.address) as client:
        async with RogueWorker(plane.worker_address, greeting) as rogue:
            if rogue.welcome is None or not rogue.welcome.accepted:
                event("hello refused")
                return
            event("hello accepted")
            task = asyncio.create_task(client.generate([5, 6, 7], max_new_tokens=3, ignore_eos=True))
            try:
                plan = await rogue.plan(timeout=3)
            except (TimeoutError, AssertionError):
                plan = None  # the request went to the real worker
            if plan is not None:
                event(f"answered: {answer[0]}")
                await _answer(rogue, plan, answer)
        # The rogue is gone now, whatever it answered (a silent one would be caught by the step deadline).
        gen = await asyncio.wait_for(task, 30)
    # Whatever the rogue did, the request got all its tokens: from the rogue while it behaved, then
    # from the real worker (a stop only when the rogue's hello made its token an EOS).
    assert (gen.finish_reason, gen.completion_tokens) == ("length", 3) or gen.finish_reason == "stop", gen
    assert all(0 <= t < 1024 for t in gen.token_ids)


async def _answer(rogue: RogueWorker, plan: StepPlan, answer: tuple[str, list[object]]) -> None:
    kind, values = answer
    result = honest_result(plan, set())
    if kind == "mangled":
        # Any int32 tokens, any count, and sometimes a few stray bytes (no whole number of tokens).
        ints = [int(v) for v in values]  # type: ignore[call-overload]
        tokens = tokens_bytes([((v + 2**31) % 2**32) - 2**31 for v in ints[: len(ints) // 2 + 1]])
        result.token_ids = tokens + b"\x01" * (len(ints) % 3)
        result.wait_s = [0.0, -1.0, float("inf")][ints[0] % 3] if ints else 0.0
    if kind == "garbage":
        await rogue.send_raw(wk_pb.WorkerMessage(result=wk_pb.StepResult(step_id=len(values), error="")))
    elif kind == "empty":
        await rogue.send_raw(wk_pb.WorkerMessage())
    elif kind == "hello-again":
        await rogue.send_raw(wk_pb.WorkerMessage(hello=hello("a-rogue", model_fingerprint=FINGERPRINT)))
    else:
        await rogue.send(result)


@pytest.mark.parametrize("kind", ANSWERS)
@settings(FUZZ, max_examples=40)
@given(greeting=hellos(), values=VALUES)
def test_any_hello_or_result_costs_at_most_that_worker(
    plane: ControlProcess, kind: str, greeting, values
) -> None:  # type: ignore[no-untyped-def]
    """How the rogue answers the one plan it gets: honestly, mangled, or with garbage."""

    async def round_trip() -> None:
        await _rogue_round(plane, greeting, (kind, values))
        await _good(plane.address)

    asyncio.run(round_trip())
    assert plane.control.poll() is None


# --- the gateway: any OpenAI body gets a 2xx or an OpenAI-shaped 4xx, never a 5xx ---------------


@pytest.fixture(scope="module")
def gateway(plane: ControlProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`stepwise gateway` (the embedded model's chat template) in front of the plane; its base URL.
    Its log goes to a file, read by the test for tracebacks."""
    tmp = tmp_path_factory.mktemp("fuzz-gateway")
    ready, log = tmp / "gateway.json", tmp / "gateway.log"
    args = ["gateway", "--control", plane.address, "--port", "0", "--ready-file", str(ready)]
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stepwise.cli", *args], stdout=out, stderr=out)
    try:
        yield f"http://127.0.0.1:{ready_file_sync(ready, proc, 60, 'the gateway', log=log)['port']}"
        assert "Traceback" not in log.read_text(), log.read_text()[-5000:]
    finally:
        stop_processes([proc])


# Any JSON value: surrogates (one alone is valid JSON but no UTF-8 string), integers of any size,
# NaN and infinities (Python's JSON reads them), nested lists and objects.
SURROGATES = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
ABSURD_INTS = st.sampled_from([2**31, -(2**31) - 1, 2**63, 2**64, -(2**64), 10**30]) | st.integers()
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | ABSURD_INTS | st.floats() | st.text(max_size=8) | SURROGATES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def json_fragments(draw: st.DrawFn) -> str:
    """Any JSON value as text, or what json.dumps cannot write: nesting past the decoder's
    recursion, integers past Python's 4,300 digits, a float past the double range."""
    kind = draw(st.sampled_from(["value"] * 6 + ["deep", "digits", "overflow"]))
    if kind == "deep":
        depth = draw(st.sampled_from([200, 999, 1000, 20_000]))
        return "[" * depth + "]" * depth
    if kind == "digits":
        return "9" * draw(st.sampled_from([19, 20, 4300, 4301, 10_000]))
    if kind == "overflow":
        return "1e400"
    return json.dumps(draw(JSON_VALUES))


def _as_json(strategy: st.SearchStrategy[object]) -> st.SearchStrategy[str]:
    return strategy.map(json.dumps)


def _sized(make: Callable[[int], object], sizes: list[int]) -> st.SearchStrategy[str]:
    """A value of absurd size (past the control plane's limits, past the gateway's body limit)."""
    return st.sampled_from(sizes).map(lambda n: json.dumps(make(n)))


TEXT = st.text(max_size=12)
IDS = st.lists(st.integers(0, 1100), min_size=1, max_size=8)
FEW, REAL = st.integers(0, 8), st.floats(0, 1.5)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"])},
        optional={"content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}))},
    ),
    min_size=1,
    max_size=3,
)
# Every field of both request schemas, as a value a client would send (SENSIBLE) and as one meant
# to break something (ODD: past the protocol's int32 and uint64, lone surrogates, sizes past the
# control plane's and the gateway's limits, refused options); ODD_OR_ANY adds wrong types.
SENSIBLE: dict[str, st.SearchStrategy[str]] = {
    "prompt": _as_json(TEXT.filter(bool) | IDS | st.lists(TEXT.filter(bool), min_size=1, max_size=1)),
    "messages": _as_json(MESSAGES),
    "model": _as_json(st.just("embedded")),
    "max_tokens": _as_json(FEW),
    "max_completion_tokens": _as_json(FEW),
    "min_tokens": _as_json(FEW),
    "temperature": _as_json(REAL),
    "top_p": _as_json(st.floats(0.1, 1)),
    "top_k": _as_json(st.integers(-1, 8)),
    "min_p": _as_json(st.floats(0, 1)),
    "repetition_penalty": _as_json(st.floats(0.5, 2)),
    "frequency_penalty": _as_json(st.floats(-2, 2)),
    "presence_penalty": _as_json(st.floats(-2, 2)),
    "stop": _as_json(TEXT.filter(bool) | st.lists(TEXT.filter(bool), max_size=3)),
    "stop_token_ids": _as_json(st.lists(st.integers(0, 1100), max_size=3)),
    "ignore_eos": _as_json(st.booleans()),
    "seed": _as_json(st.integers(0, 2**64 - 1)),
    "n": _as_json(st.integers(1, 4)),
    "stream": _as_json(st.booleans()),
    "stream_options": _as_json(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": _as_json(TEXT),
    "priority": _as_json(FEW),
    "logprobs": _as_json(st.none()),
    "top_logprobs": _as_json(st.none()),
    "echo": _as_json(st.just(False)),
    "suffix": _as_json(st.none()),
    "best_of": _as_json(st.none()),
    "add_generation_prompt": _as_json(st.booleans()),
}
ODD_TEXT = _as_json(SURROGATES | st.text().map(lambda t: t + "\ud800"))
ODD_INT = _as_json(ABSURD_INTS | st.integers(-3, -1))
ODD_REAL = _as_json(st.floats())
ODD: dict[str, st.SearchStrategy[str]] = {
    "prompt": ODD_TEXT
    | _as_json(st.just([]) | st.lists(ABSURD_INTS, min_size=1, max_size=3))
    | _as_json(st.lists(st.lists(ABSURD_INTS, max_size=2), min_size=1, max_size=3))
    # 4 MiB of text is the control plane's --max-prompt-bytes; 8 MiB of body the gateway's limit.
    | _sized(lambda n: "Once upon a time " * n, [250_000, 600_000])
    | _sized(lambda n: [5] * n, [5000, 3_000_000]),
    "messages": _as_json(
        st.just([]) | st.lists(st.fixed_dictionaries({"role": TEXT, "content": JSON_VALUES}))
    )
    | ODD_TEXT.map(lambda t: f'[{{"role": "user", "content": {t}}}]')
    | ODD_TEXT.map(lambda t: f'[{{"role": "user", "content": "x", "name": {t}}}]'),
    "stop": ODD_TEXT | _sized(lambda n: ["x"] * n, [65, 3000]),
    "stop_token_ids": _as_json(st.lists(ABSURD_INTS, min_size=1, max_size=3))
    | _sized(lambda n: list(range(n)), [1025, 3000]),
    "seed": _as_json(st.sampled_from([-1, 2**64, 10**30])),
    "user": ODD_TEXT | _sized(lambda n: "u" * n, [257, 100_000]),
    "model": ODD_TEXT,
    "logprobs": _as_json(st.booleans() | FEW),
    "top_logprobs": _as_json(FEW),
    "echo": _as_json(st.just(True)),
    "suffix": ODD_TEXT | _as_json(TEXT.filter(bool)),
    "best_of": _as_json(FEW),
    **{
        name: ODD_INT
        for name in ("max_tokens", "max_completion_tokens", "min_tokens", "top_k", "n", "priority")
    },
    **{
        name: ODD_REAL
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        )
    },
}
AUTHORIZATION = st.none() | st.sampled_from([b"Bearer ok", b"Bearer k\xc3\xa9y", b"Bearer a\tb", b"Basic x"])


@st.composite
def openai_bodies(draw: st.DrawFn) -> tuple[str, bytes, bytes | None]:
    """(path, body, Authorization): a few fields of either schema, sensible but for zero to two odd
    ones (or of any type at all); now and then no object at all, or bytes that are no JSON. A body
    with every field odd would be refused for its first, and the others never reached."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    required = "prompt" if path == "/v1/completions" else "messages"
    names = [required, *draw(st.lists(st.sampled_from(sorted(SENSIBLE)), max_size=6, unique=True))]
    odd = draw(st.lists(st.sampled_from(names), max_size=2, unique=True))
    fields = {}
    for name in names:
        odd_or_any = ODD.get(name, json_fragments()) | json_fragments()
        fields[name] = draw(odd_or_any if name in odd else SENSIBLE[name])
    if draw(st.integers(0, 19)) == 0:
        del fields[required]
    if draw(st.integers(0, 9)) == 0:
        fields[draw(TEXT | SURROGATES)] = draw(json_fragments())  # a field no schema has
    body = "{" + ", ".join(f"{json.dumps(name)}: {value}" for name, value in fields.items()) + "}"
    shape = draw(st.sampled_from(["object"] * 18 + ["other", "bytes"]))
    if shape == "other":
        return path, draw(json_fragments()).encode(), None
    if shape == "bytes":
        return path, draw(st.binary(max_size=64)), None
    return path, body.encode(), draw(AUTHORIZATION)


async def _gateway_call(http: httpx.AsyncClient, path: str, body: bytes, authorization: bytes | None) -> None:
    """A 2xx or an OpenAI-shaped 4xx; a 200 stream is read a few events in, then left."""
    headers = {b"content-type": b"application/json"}
    if authorization is not None:
        headers[b"authorization"] = authorization
    async with http.stream("POST", path, content=body, headers=headers) as reply:
        event(f"HTTP {reply.status_code}")
        assert reply.status_code < 500, (reply.status_code, (await reply.aread())[:300])
        if reply.status_code >= 400:
            error = json.loads(await reply.aread())["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        elif reply.headers["content-type"].startswith("text/event-stream"):
            lines = reply.aiter_lines()
            async for line in lines:
                if line.startswith("data: [DONE]"):
                    break
        else:
            assert "choices" in json.loads(await reply.aread())


async def _good_gateway(http: httpx.AsyncClient) -> None:
    good = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
    reply = await http.post("/v1/completions", json=good)
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["usage"]["completion_tokens"] == 3


# Past the body limit, as text and as token ids, at once: the draws reach these sizes seldom.
HUGE = [
    ("/v1/completions", json.dumps({"prompt": "Once upon a time " * 600_000}).encode(), None),
    ("/v1/completions", json.dumps({"prompt": [5] * 3_000_000, "stream": True}).encode(), b"Bearer ok"),
]


@settings(FUZZ, max_examples=60)
@given(bodies=st.lists(openai_bodies(), min_size=1, max_size=3))
@example(bodies=HUGE)
def test_any_openai_body_gets_a_2xx_or_an_openai_shaped_4xx(gateway: str, bodies) -> None:  # type: ignore[no-untyped-def]
    async def batch() -> None:
        async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
            await asyncio.gather(*(_gateway_call(http, *body) for body in bodies))
            await _good_gateway(http)

    asyncio.run(batch())
