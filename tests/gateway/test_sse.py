"""Server-sent events: orjson's bytes, parsed by a client exactly as json's text was."""

from __future__ import annotations

import json

from gateway.app import SSE_DONE, sse


def _parsed(event: bytes) -> object:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    return json.loads(event[6:])


def test_an_event_is_one_data_line_of_the_same_json() -> None:
    chunk = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "acme/tiny",
        "choices": [{"index": 0, "text": 'é "quoted"\n\u2028', "logprobs": None, "finish_reason": None}],
    }
    event = sse(chunk)
    assert _parsed(event) == chunk
    assert "é".encode() in event  # UTF-8 as it is, not \u escapes
    assert (
        event == b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    )
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_what_orjson_refuses_json_writes() -> None:
    for data in ({"seed": 2**64 + 1}, {"top": {1: -0.5}}):
        assert _parsed(sse(data)) == json.loads(json.dumps(data))
