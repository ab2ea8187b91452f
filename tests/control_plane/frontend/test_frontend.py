"""A frontend's side of a request, in process: core messages in, client events out.

The core's messages are built by hand here; the real link is exercised end to end in tests/e2e.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane import link_params
from control_plane.config import ControlConfig, Limits
from control_plane.frontend import client_codec
from control_plane.frontend.core_link import Frontend
from control_plane.frontend.detokenize import IncrementalDetokenizer
from control_plane.frontend.generation import as_run
from control_plane.frontend.samples import Call, Chunk, Done, Lost
from control_plane.frontend.server import GRPC_DEFAULT_MESSAGE_BYTES, max_request_bytes
from control_plane.link import UID_LINK_SHIFT
from control_plane.tokenizer import Tokenizer
from protos.stepwise.v1 import frontend_pb2 as fe_pb
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.worker import Grammar
from stepwise.models import resolve_model

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("embedded"))


def _frontend(tokenizer: Tokenizer, interval: int = 1) -> Frontend:
    frontend = Frontend(ControlConfig(model_dir=Path("."), stream_interval=interval), tokenizer)
    frontend.link_id = 7
    frontend.apply(fe_pb.CoreMessage(state=fe_pb.CoreState(workers=1, max_context=2048, vocab_size=500)))
    return frontend


def _open(frontend: Frontend, tokenizer: Tokenizer, **sampling: object) -> Call:
    request = gen_pb.GenerateRequest(text="Once upon a time", sampling=gen_pb.SamplingParams(**sampling))
    inp = client_codec.generate_input_from_proto(request)
    call = frontend.open_call(inp, "r1", tokenizer.encode(inp.text or ""), "owner")
    frontend.apply(fe_pb.CoreMessage(verdicts=[fe_pb.Verdict(uid=call.samples[0].uid, code=0)]))
    return call


def _tokens(uid: int, ids: list[int]) -> fe_pb.CoreMessage:
    return fe_pb.CoreMessage(
        token_uids=np.full(len(ids), uid, dtype="<u8").tobytes(),
        token_ids=np.asarray(ids, dtype="<i4").tobytes(),
    )


def _events(frontend: Frontend, call: Call) -> list[Chunk | Done]:
    """What the call's handler would send if it ran now."""
    return frontend.take(call)  # type: ignore[return-value]


def _text_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    return ids[1:] if ids and ids[0] == tokenizer.bos_token_id else ids


async def test_uids_carry_the_link_id_and_the_arrival_names_every_sample(tokenizer: Tokenizer) -> None:
    frontend = _frontend(tokenizer)
    call = _open(frontend, tokenizer, n=3)
    assert [s.uid >> UID_LINK_SHIFT for s in call.samples] == [7, 7, 7]
    assert len({s.uid for s in call.samples}) == 3
    (arrival,) = frontend._outbox.arrivals
    assert list(arrival.uids) == [s.uid for s in call.samples]
    # The checked parameters travel, not the client's message: the core reads them back as they are.
    request = gen_pb.GenerateRequest(text="Once upon a time", sampling=gen_pb.SamplingParams(n=3))
    assert link_params.from_arrival(arrival) == client_codec.generate_input_from_proto(request).params
    assert np.frombuffer(arrival.input_ids, dtype="<i4").tolist() == tokenizer.encode("Once upon a time")
    assert arrival.prompt_field == "text"


async def test_the_first_token_goes_at_once_then_one_message_per_interval(tokenizer: Tokenizer) -> None:
    frontend = _frontend(tokenizer, interval=4)
    call = _open(frontend, tokenizer)
    uid = call.samples[0].uid
    ids = _text_ids(tokenizer, " and the king said hello to the queen of the land")[:10]
    sizes = []
    for token in ids:
        frontend.apply(_tokens(uid, [token]))
        sizes += [len(e.token_ids) for e in _events(frontend, call) if isinstance(e, Chunk)]
    assert sizes == [1, 4, 4]  # token 1 at once; then 2-5 and 6-9; the tenth waits
    frontend.apply(fe_pb.CoreMessage(finished=[fe_pb.LinkFinished(uid=uid, kind="length", cached_tokens=3)]))
    last = _events(frontend, call)
    assert isinstance(last[0], Chunk) and last[0].token_ids == (ids[9],)
    done = last[-1]
    assert isinstance(done, Done) and done.completion_tokens == 10 and done.cached_tokens == 3
    assert done.reason.kind.value == "length"
    assert not frontend.samples


async def test_the_reader_only_records_and_a_late_handler_gets_one_message_of_everything(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Applying the core's messages decodes nothing for a sample without stop strings: the handler
    decodes when it runs, once, for every id that arrived meanwhile (so a backlog of token messages
    never builds up in front of the verdicts and replies behind it)."""
    frontend = _frontend(tokenizer, interval=1)
    call = _open(frontend, tokenizer)
    uid = call.samples[0].uid
    ids = _text_ids(tokenizer, " and the king said hello to the queen of the land, who smiled")
    # Detokenizing is pushing ids into the sample's detokenizer (a byte-level tokenizer's are not
    # decoded by `Tokenizer.decode` at all): counted there.
    pushes: list[tuple[int, ...]] = []
    real_push = IncrementalDetokenizer.push

    def counted(self: IncrementalDetokenizer, token_ids: Sequence[int]) -> str:
        pushes.append(tuple(token_ids))
        return real_push(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "push", counted)
    for token in ids:
        frontend.apply(_tokens(uid, [token]))
    assert pushes == [] and call.due == [call.samples[0]]
    (chunk,) = _events(frontend, call)
    assert isinstance(chunk, Chunk) and chunk.token_ids == tuple(ids)
    assert chunk.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert pushes == [tuple(ids)], "the handler detokenized once, every id at once"
    assert _events(frontend, call) == []
    frontend.apply(_tokens(uid, [ids[0]]))
    assert [len(e.token_ids) for e in _events(frontend, call) if isinstance(e, Chunk)] == [1]


async def test_a_finish_after_a_due_message_sends_each_token_once_in_order(tokenizer: Tokenizer) -> None:
    frontend = _frontend(tokenizer, interval=1)
    call = _open(frontend, tokenizer)
    uid = call.samples[0].uid
    ids = _text_ids(tokenizer, " and the king said hello")
    frontend.apply(_tokens(uid, ids))
    frontend.apply(fe_pb.CoreMessage(finished=[fe_pb.LinkFinished(uid=uid, kind="length")]))
    events = _events(frontend, call)
    assert [type(e) for e in events] == [Chunk, Done]
    assert events[0].token_ids == tuple(ids)  # type: ignore[union-attr]


async def test_a_stop_string_ends_the_stream_here_and_tells_the_core(tokenizer: Tokenizer) -> None:
    frontend = _frontend(tokenizer, interval=8)
    call = _open(frontend, tokenizer, stop=["king"])
    uid = call.samples[0].uid
    for token in _text_ids(tokenizer, " and the king said hello"):
        frontend.apply(_tokens(uid, [token]))
    events = _events(frontend, call)
    text = "".join(e.text for e in events if isinstance(e, Chunk))
    assert text == " and the "
    done = events[-1]
    assert isinstance(done, Done) and done.reason.kind.value == "stop" and "king" in done.reason.message
    (stop,) = frontend._outbox.stops
    assert stop.uid == uid and stop.stop == "king"
    # The core finishes it one step late: what it produced meanwhile, and its finish, are dropped.
    frontend.apply(_tokens(uid, [5, 6]))
    frontend.apply(fe_pb.CoreMessage(finished=[fe_pb.LinkFinished(uid=uid, kind="stop")]))
    assert _events(frontend, call) == []


async def test_a_refused_call_gets_the_status_and_leaves_nothing_behind(tokenizer: Tokenizer) -> None:
    frontend = _frontend(tokenizer)
    request = gen_pb.GenerateRequest(text="hi", sampling=gen_pb.SamplingParams(n=2))
    inp = client_codec.generate_input_from_proto(request)
    call = frontend.open_call(inp, "r2", tokenizer.encode("hi"), "owner")
    code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    message = fe_pb.CoreMessage(verdicts=[fe_pb.Verdict(uid=call.samples[0].uid, code=code, message="full")])
    frontend.apply(message)
    assert call.verdict is not None and call.verdict.result() == (code, "full")
    assert not frontend.samples


async def test_losing_the_core_ends_every_call_with_unavailable(tokenizer: Tokenizer) -> None:
    frontend = _frontend(tokenizer)
    running = _open(frontend, tokenizer)
    request = gen_pb.GenerateRequest(text="hi")
    waiting = frontend.open_call(
        client_codec.generate_input_from_proto(request), "r3", tokenizer.encode("hi"), "o"
    )
    frontend._end_everything("the control plane's core went away; retry")
    assert waiting.verdict is not None and waiting.verdict.result()[0] == grpc.StatusCode.UNAVAILABLE.value[0]
    # A call already streaming ends with status UNAVAILABLE too: the control plane failed as a whole.
    lost = _events(frontend, running)[-1]
    assert isinstance(lost, Lost) and "went away" in lost.message
    assert not frontend.samples


def test_the_client_port_takes_twice_the_largest_allowed_request() -> None:
    """Every field at its limit (4-byte characters, negative token ids): a request up to twice that
    reaches the service and is refused naming its field, never by gRPC's size limit."""
    limits = Limits(
        max_prompt_bytes=8 << 20, max_stop_strings=8, max_stop_chars=4096, max_stop_token_ids=1024
    )
    sampling = gen_pb.SamplingParams(
        stop=["\U0001f600" * 512] * 8,
        stop_token_ids=[-1] * 1024,
        max_new_tokens=1 << 30,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        seed=(1 << 64) - 1,
        n=64,
    )
    largest = gen_pb.GenerateRequest(
        text="x" * limits.max_prompt_bytes,
        sampling=sampling,
        request_id="\U0001f600" * 256,
        routing_key="\U0001f600" * 256,
        priority=-(1 << 31),
    )
    assert 2 * largest.ByteSize() <= max_request_bytes(limits)
    # input_ids prompts, which --max-prompt-bytes does not bound, keep gRPC's own 4 MiB at least.
    assert max_request_bytes(Limits(max_prompt_bytes=0)) >= 2 * GRPC_DEFAULT_MESSAGE_BYTES


@settings(max_examples=300, deadline=None)
@given(
    rid=st.text(max_size=40),
    index=st.integers(0, 63),
    ids=st.lists(st.integers(0, (1 << 31) - 1) | st.integers(0, 200_000), max_size=40),
    text=st.text(max_size=60),
)
def test_a_hand_encoded_chunk_is_the_bytes_protobuf_writes(
    rid: str, index: int, ids: list[int], text: str
) -> None:
    """The streaming path sends chunks encoded by hand; a client reads exactly what protobuf wrote."""
    got = client_codec.chunk_bytes(client_codec.request_id_field(rid), index, ids, text)
    want = client_codec.chunk_response(rid, index, ids, text).SerializeToString()
    assert got == want
    assert gen_pb.GenerateResponse.FromString(got) == client_codec.chunk_response(rid, index, ids, text)


@pytest.mark.parametrize(
    ("mode", "top", "processed"), [("raw", 2, False), ("processed", 2, True), ("processed", None, False)]
)
def test_what_the_core_runs_carries_the_compiled_grammar_and_the_logprobs_mode(
    mode: str, top: int | None, processed: bool
) -> None:
    """The frontend stamps what the core used to: the backend that compiled the grammar here, and
    processed logprobs under --logprobs-mode processed for a request that asks for logprobs."""
    sampling = gen_pb.SamplingParams(regex="a+", top_logprobs=top)
    params = client_codec.sampling_from_proto(sampling)
    assert params.sampler.grammar is not None and params.sampler.grammar.backend == ""
    compiled = Grammar("xgrammar", "regex", "a+")
    run = as_run(params, compiled, mode)
    assert run.sampler.grammar is compiled
    assert run.sampler.processed_logprobs is processed
    assert dataclasses.replace(run, sampler=params.sampler) == params
