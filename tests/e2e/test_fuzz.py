"""Fuzzing a live control plane (a real process, a sim worker) from both sides.

Clients: any GenerateRequest hypothesis can build, every field and absurd sizes included, and raw
bytes that are no request at all, must get a stream that ends properly or a clean status: never
UNKNOWN or INTERNAL, never a hang. Workers: any hello and any StepResult a rogue worker sends must
cost at most that worker. After each example a good request must still be served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from clients.client import StepwiseClient
from data_plane.messages import StepPlan
from data_plane.models.loader import model_fingerprint
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import worker_pb2 as wk_pb
from stepwise.embedded import resolve_model
from tests.e2e.conftest import ControlProcess
from tests.e2e.rogue import RogueWorker, hello, honest_result, tokens_bytes

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
    control = ControlProcess(flags, tmp_path_factory.mktemp("fuzz"))
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

    from control_plane.client_codec import describe_unparsable

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
