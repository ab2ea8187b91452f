"""Log probabilities and echo in OpenAI's shapes, from synthetic GenerateResponse streams (the real
app through ASGI, the official `openai` client, a fake control plane: tests/gateway/fake.py)."""

from __future__ import annotations

import math

import pytest

from gateway.app import _renamed
from gateway.chat import load_template
from gateway.errors import from_grpc
from gateway.formats import ChatFormat, Collected, CompletionFormat
from protos.stepwise.v1 import generation_pb2 as gen_pb
from stepwise.models import resolve_model
from tests.gateway.fake import (
    BOS,
    FakeControlPlane,
    app_with,
    generated,
    http_client,
    logprob,
    openai_client,
    piece,
    refusal,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def plane() -> FakeControlPlane:
    return FakeControlPlane()


async def test_lm_eval_loglikelihood_request(plane: FakeControlPlane) -> None:
    """lm-eval-harness's exact request: the prompt's own log probabilities (the first null), then
    the generated token's, aligned with `tokens`; the prompt scored from position 0."""
    ids = [BOS, 40, 41, 42, 43]
    client = openai_client(app_with(plane))
    reply = await client.completions.create(
        model="fake", prompt=[ids], max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    asked = plane.requests[-1].sampling
    assert asked.logprobs and asked.top_logprobs == 1 and asked.logprob_start_len == 0
    choice = reply.choices[0]
    new = generated(ids, 0, 0)
    assert choice.logprobs is not None
    lps = choice.logprobs.token_logprobs
    assert lps is not None
    assert lps[0] is None
    expected = [logprob(i, ids[i]) for i in range(1, len(ids))] + [logprob(len(ids), new)]
    assert lps[1:] == pytest.approx(expected)
    assert choice.logprobs.tokens == [piece(t) for t in [*ids, new]]
    tops = choice.logprobs.top_logprobs
    assert tops is not None and tops[0] is None and all(len(t) == 1 for t in tops[1:])
    # The text: the prompt as decoded (BOS skipped), then the completion; offsets by token lengths.
    assert choice.text == "FGHI" + piece(new)
    lengths = [len(piece(t)) for t in [*ids, new]]
    assert choice.logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]


async def test_echo_with_no_tokens_and_without_logprobs(plane: FakeControlPlane) -> None:
    client = openai_client(app_with(plane))
    zero = await client.completions.create(model="fake", prompt="Hi", max_tokens=0, logprobs=0, echo=True)
    assert zero.choices[0].text == "Hi"
    assert zero.choices[0].logprobs is not None
    lps = zero.choices[0].logprobs.token_logprobs
    assert lps is not None and lps[0] is None
    assert lps[1:] == pytest.approx([logprob(1, ord("H") - 30), logprob(2, ord("i") - 30)])
    assert zero.choices[0].logprobs.top_logprobs == [None, {}, {}]
    plain = await client.completions.create(model="fake", prompt="Hi", max_tokens=2, echo=True)
    assert not plane.requests[-1].sampling.HasField("logprob_start_len")
    assert plain.choices[0].text.startswith("Hi") and len(plain.choices[0].text) == 4
    assert plain.choices[0].logprobs is None
    # A token-id prompt without logprobs: its text is decoded by the gateway's tokenizer.
    ids = await client.completions.create(model="fake", prompt=[BOS, 40, 41], max_tokens=1, echo=True)
    assert ids.choices[0].text.startswith("FG")


async def test_four_prompts_two_samples_each_with_logprobs(plane: FakeControlPlane) -> None:
    prompts = ["ab", "cd", "ef", "gh"]
    client = openai_client(app_with(plane))
    reply = await client.completions.create(model="fake", prompt=prompts, n=2, max_tokens=3, logprobs=2)
    assert [c.index for c in reply.choices] == list(range(8))
    for c in reply.choices:
        prompt, sample = divmod(c.index, 2)
        ids = plane.tokenizer.encode(prompts[prompt])
        tokens = [generated(ids, sample, k) for k in range(3)]
        assert c.text == "".join(piece(t) for t in tokens)
        assert c.logprobs is not None and c.logprobs.tokens == [piece(t) for t in tokens]
        assert c.logprobs.token_logprobs == pytest.approx(
            [logprob(len(ids) + k, t) for k, t in enumerate(tokens)]
        )
        assert c.logprobs.top_logprobs is not None and all(len(t) == 2 for t in c.logprobs.top_logprobs)
        assert c.logprobs.text_offset == [0, 1, 2]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (12, 24)


async def test_streamed_echo_and_logprobs_add_up_to_the_whole(plane: FakeControlPlane) -> None:
    client = openai_client(app_with(plane))
    kwargs = {"model": "fake", "prompt": ["ab", "xyz"], "n": 2, "max_tokens": 3, "logprobs": 1, "echo": True}
    whole = await client.completions.create(**kwargs)  # type: ignore[call-overload]
    texts, tokens, lps, offsets = ({i: [] for i in range(4)} for _ in range(4))  # type: ignore[var-annotated]
    async for chunk in await client.completions.create(**kwargs, stream=True):  # type: ignore[call-overload]
        for c in chunk.choices:
            texts[c.index].append(c.text)
            if c.logprobs is not None:
                tokens[c.index] += c.logprobs.tokens
                lps[c.index] += c.logprobs.token_logprobs
                offsets[c.index] += c.logprobs.text_offset
    for c in whole.choices:
        assert "".join(texts[c.index]) == c.text
        assert tokens[c.index] == c.logprobs.tokens
        assert lps[c.index] == c.logprobs.token_logprobs
        assert offsets[c.index] == c.logprobs.text_offset


async def test_logprobs_past_the_servers_limit_are_a_400_naming_logprobs(plane: FakeControlPlane) -> None:
    async with http_client(app_with(plane)) as http:
        for value, param in [(21, "logprobs"), (-1, "logprobs")]:
            reply = await http.post("/v1/completions", json={"prompt": "x", "logprobs": value})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    # The protocol's logprob_start_len is what completions call echo.
    refused = _renamed(
        from_grpc(refusal("sampling.logprob_start_len: too long")), {"logprob_start_len": "echo"}
    )
    assert (refused.param, refused.message) == ("echo", "echo: too long")


async def test_echo_of_a_token_prompt_needs_the_tokenizer(plane: FakeControlPlane) -> None:
    async with http_client(app_with(plane, tokenizer=False)) as http:
        reply = await http.post("/v1/completions", json={"prompt": [BOS, 40], "echo": True})
        assert reply.status_code == 501 and reply.json()["error"]["param"] == "echo"
        reply = await http.post("/v1/completions", json={"prompt": [BOS, 40], "echo": True, "logprobs": 0})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"].startswith("F")


async def test_chat_logprobs_whole_and_streamed(plane: FakeControlPlane) -> None:
    template = load_template(resolve_model("embedded"))
    client = openai_client(app_with(plane, template))
    messages = [{"role": "user", "content": "Hello"}]
    whole = await client.chat.completions.create(
        model="fake",
        messages=messages,
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
    )
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    streamed = []
    async for chunk in await client.chat.completions.create(
        model="fake",
        messages=messages,
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
        stream=True,  # type: ignore[arg-type]
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = await client.chat.completions.create(model="fake", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None and not plane.requests[-1].sampling.logprobs
    async with http_client(app_with(plane, template)) as http:
        reply = await http.post("/v1/chat/completions", json={"messages": messages, "top_logprobs": 2})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs"


def test_an_infinite_logprob_is_written_as_very_unlikely() -> None:
    """JSON has no -inf (a token the processed distribution filtered out)."""
    collected = Collected.of(1)
    chunk = gen_pb.TokenChunk(index=0, token_ids=[5], text="x")
    chunk.logprobs.append(
        gen_pb.TokenLogprob(
            token_id=5, logprob=-math.inf, token="x", top_ids=[6], top_logprobs=[-0.1], top_tokens=["y"]
        )
    )
    event = collected.apply(gen_pb.GenerateResponse(chunk=chunk))
    completion = CompletionFormat("m", logprobs=True).events(event, collected)[0]["choices"][0]["logprobs"]
    assert completion["token_logprobs"] == [-9999.0]
    assert completion["top_logprobs"] == [{"y": pytest.approx(-0.1)}]
    chat = ChatFormat("m", logprobs=True).events(event, collected)[0]["choices"][0]["logprobs"]
    assert chat["content"][0]["logprob"] == -9999.0


async def test_models_report_the_served_name(plane: FakeControlPlane) -> None:
    client = openai_client(app_with(plane, model_name="acme/tiny"))
    assert [m.id for m in (await client.models.list()).data] == ["acme/tiny"]
    card = await client.models.retrieve("acme/tiny")
    assert card.id == "acme/tiny" and card.model_extra == {"max_model_len": plane.max_context}
