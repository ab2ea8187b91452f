"""vLLM's `/tokenize` and `/detokenize`, and `/version`, against a fake control plane and tokenizer
(tests/gateway/fake.py)."""

from __future__ import annotations

import pytest

from gateway.chat import load_template
from stepwise.models import resolve_model
from tests.gateway.fake import BOS, FakeControlPlane, app_with, http_client

pytestmark = pytest.mark.timeout(60)


async def test_tokenize_detokenize_round_trip_and_version() -> None:
    plane = FakeControlPlane()
    async with http_client(app_with(plane)) as http:
        reply = (await http.post("/tokenize", json={"model": "fake", "prompt": "Hi!"})).json()
        assert reply == {
            "count": 4,
            "max_model_len": plane.max_context,
            "tokens": plane.tokenizer.encode("Hi!"),
        }
        text = (await http.post("/detokenize", json={"tokens": reply["tokens"]})).json()
        assert text == {"prompt": "<s>Hi!"}  # special tokens kept, as vLLM decodes
        assert (await http.get("/version")).json() == {"version": "9.9.9"}


async def test_tokenize_messages_with_the_chat_template() -> None:
    plane = FakeControlPlane()
    template = load_template(resolve_model("embedded"))
    assert template is not None
    messages = [{"role": "user", "content": "Hello"}]
    async with http_client(app_with(plane, template)) as http:
        for add in (True, False):
            body = {"messages": messages, "add_generation_prompt": add}
            reply = (await http.post("/tokenize", json=body)).json()
            assert reply["tokens"] == plane.tokenizer.encode(template.render(messages, add))


@pytest.mark.parametrize(
    ("path", "body", "param", "status"),
    [
        ("/tokenize", {"prompt": "x", "return_token_strs": True}, "return_token_strs", 400),
        ("/tokenize", {"prompt": "x", "add_special_tokens": False}, "add_special_tokens", 400),
        ("/tokenize", {}, "prompt", 400),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt", 400),
        ("/detokenize", {"tokens": [BOS, 100]}, "tokens.1", 400),
        ("/detokenize", {"tokens": [-1]}, "tokens.0", 400),
        ("/detokenize", {"tokens": "abc"}, "tokens", 400),
    ],
)
async def test_bad_token_requests_are_a_400_naming_the_field(
    path: str, body: dict[str, object], param: str, status: int
) -> None:
    async with http_client(app_with(FakeControlPlane())) as http:
        reply = await http.post(path, json=body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


async def test_without_a_tokenizer_the_token_endpoints_are_501() -> None:
    async with http_client(app_with(FakeControlPlane(), tokenizer=False)) as http:
        assert (await http.post("/tokenize", json={"prompt": "x"})).status_code == 501
        assert (await http.post("/detokenize", json={"tokens": [1]})).status_code == 501
