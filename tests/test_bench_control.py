"""bench/bench_control.py's SSE client (its --gateway-streams mode): the raw HTTP/1.1 chunked reader
and its counts, against a tiny local server that answers as the gateway does."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(30)


def _load_bench_control():  # type: ignore[no-untyped-def]
    """bench/bench_control.py as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_control", ROOT / "bench" / "bench_control.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_control"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench_control = _load_bench_control()


def _event(text: str, tokens: list[str], finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": {"tokens": tokens}, "finish_reason": finish}
    return b"data: " + json.dumps({"object": "text_completion", "choices": [choice]}).encode() + b"\n\n"


def _usage(completion_tokens: int) -> bytes:
    body = {"object": "text_completion", "choices": [], "usage": {"completion_tokens": completion_tokens}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _serve(chunks: list[bytes]) -> tuple[asyncio.Server, int, list[bytes]]:
    """A server that reads one request and answers `chunks` in the chunked transfer coding."""
    requests: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
        )
        requests.append(head + await reader.readexactly(length))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for chunk in chunks:
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], requests


async def _read(chunks: list[bytes]) -> tuple[object, list[bytes]]:
    server, port, requests = await _serve(chunks)
    async with server:
        counts, first = bench_control.Counts(), asyncio.Event()
        body = bench_control.completion_body("Once upon a time,", 4)
        await bench_control.sse_stream("127.0.0.1", port, body, bench_control.SseCount(counts, first))
        assert first.is_set()
    return counts, requests


def test_sse_client_counts_every_event_and_each_token_of_it() -> None:
    whole = _event("Once", ["Once"]) + _event("", ["\xe2"]) + _event(" up", ["\x80", " up"], "length")
    whole += _usage(4) + b"data: [DONE]\n\n"
    # Split anywhere, an event over two chunks included: the reader puts them together.
    counts, requests = asyncio.run(_read([whole[:10], whole[10:77], whole[77:]]))
    assert (counts.messages, counts.tokens, counts.finished, counts.errors) == (5, 4, 1, {})
    assert counts.token_events == 3  # the usage event and [DONE] carry none
    request = json.loads(requests[0].split(b"\r\n\r\n", 1)[1])
    assert request["stream"] and request["ignore_eos"] and request["logprobs"] == 0
    assert request["max_tokens"] == 4 and request["stream_options"] == {"include_usage": True}


def test_sse_client_counts_a_usage_that_disagrees_as_an_error() -> None:
    counts, _ = asyncio.run(_read([_event("Once", ["Once"], "length") + _usage(2) + b"data: [DONE]\n\n"]))
    assert (counts.messages, counts.tokens, counts.errors) == (3, 1, {"usage mismatch": 1})


def test_sse_client_counts_an_error_event_as_an_error() -> None:
    error = b'data: {"error": {"message": "aborted", "type": "server_error", "code": 503}}\n\n'
    counts, _ = asyncio.run(_read([_event("Once", ["Once"]) + error + b"data: [DONE]\n\n"]))
    assert (counts.messages, counts.tokens, counts.errors) == (3, 1, {"stream error 503": 1})
