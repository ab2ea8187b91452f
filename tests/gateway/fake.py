"""A stand-in control plane for the gateway's unit tests: synthetic GenerateResponse streams with
log probabilities, computed from the request alone, and a character-level tokenizer; the real app
served through httpx's ASGI transport (no process, no port)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import httpx
import openai

from gateway.app import GatewayConfig, create_app
from gateway.chat import ChatTemplate
from protos.stepwise.v1 import generation_pb2 as gen_pb

EOS, BOS = 0, 1
VOCAB = 100
MAX_TOP = 20


class FakeTokenizer:
    """`<s>` first, then one token per printable ASCII character (id = code - 30)."""

    vocab_size = VOCAB
    eos_token_ids = frozenset({EOS})

    def encode(self, text: str) -> list[int]:
        return [BOS, *(ord(c) - 30 for c in text)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(piece(i) for i in ids if not (skip_special_tokens and i in (EOS, BOS)))


def piece(token: int) -> str:
    return {EOS: "</s>", BOS: "<s>"}.get(token, chr(token + 30) if 2 <= token < VOCAB else "\ufffd")


def logprob(position: int, token: int) -> float:
    """The fake model's log probability of `token` after `position` tokens."""
    return -0.25 - 0.01 * ((position * 7 + token) % 50)


def scored(
    position: int, token: int, sampling: gen_pb.SamplingParams, first: bool = False
) -> gen_pb.TokenLogprob:
    """A TokenLogprob as the protocol defines it; the first scored prompt position has no logprob."""
    entry = gen_pb.TokenLogprob(token_id=token, token=piece(token))
    if first:
        return entry
    entry.logprob = logprob(position, token)
    tops = sorted(range(2, 2 + 2 * sampling.top_logprobs), key=lambda t: -logprob(position, t))
    for t in tops[: sampling.top_logprobs]:
        entry.top_ids.append(t)
        entry.top_logprobs.append(logprob(position, t))
        entry.top_tokens.append(piece(t))
    entry.ids_logprobs.extend(logprob(position, t) for t in sampling.token_ids_logprob)
    return entry


def generated(prompt: Sequence[int], sample: int, step: int) -> int:
    return 2 + (sum(prompt) + 3 * step + 11 * sample) % 90


def refusal(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )


class Call:
    """One Generate call: its responses, or the refusal its first read raises; cancellable."""

    def __init__(self, responses: list[gen_pb.GenerateResponse], error: Exception | None = None) -> None:
        self.responses, self.error, self.cancelled = responses, error, False

    def __aiter__(self) -> AsyncIterator[gen_pb.GenerateResponse]:
        return self._run()

    async def _run(self) -> AsyncIterator[gen_pb.GenerateResponse]:
        if self.error is not None:
            raise self.error
        for response in self.responses:
            yield response

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeControlPlane:
    """Answers Generate like a control plane would: greedy-like tokens, PromptLogprobs when asked,
    a chunk per token, then LENGTH (or STOP on `stop_token_ids`)."""

    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    requests: list[gen_pb.GenerateRequest] = field(default_factory=list)
    max_context: int = 512
    # A scripted model: the text every sample of a request answers (in chunks of `chunk_chars`
    # characters, one token each, then EOS), instead of the synthetic tokens.
    reply: Callable[[gen_pb.GenerateRequest], str] | None = None
    chunk_chars: int = 3
    # How a scripted reply ends when max_new_tokens does not cut it (reason, message).
    scripted_finish: tuple[int, str] = (gen_pb.FINISH_REASON_STOP, "eos")
    # Refuse every request with INVALID_ARGUMENT and these details (a control plane's refusal).
    refuse_with: str | None = None
    # The API keys taken (None: keys are off); the keys each GetServerInfo came with.
    keys: frozenset[str] | None = None
    asked: list[str | None] = field(default_factory=list)

    def stream(self, request: gen_pb.GenerateRequest, *, api_key: str | None = None) -> Call:
        self.requests.append(request)
        if self.refuse_with is not None:
            return Call([], refusal(self.refuse_with))
        if self.reply is not None:
            return self._scripted(request, self.reply(request))
        s = request.sampling
        prompt = (
            list(request.input_ids.ids)
            if request.HasField("input_ids")
            else self.tokenizer.encode(request.text)
        )
        if s.top_logprobs > MAX_TOP:
            return Call(
                [],
                refusal(
                    f"sampling.top_logprobs: must be <= {MAX_TOP} (--max-top-logprobs), got {s.top_logprobs}"
                ),
            )
        start = s.logprob_start_len if s.HasField("logprob_start_len") else -1
        if start >= len(prompt):
            return Call(
                [], refusal(f"sampling.logprob_start_len: must be below the prompt's length {len(prompt)}")
            )
        rid = request.request_id
        out: list[gen_pb.GenerateResponse] = []
        if start >= 0:
            positions = [scored(i, prompt[i], s, first=i == start) for i in range(start, len(prompt))]
            event = gen_pb.PromptLogprobs(
                start=start, positions=positions, text=self.tokenizer.decode(prompt[start:])
            )
            out.append(gen_pb.GenerateResponse(request_id=rid, prompt_logprobs=event))
        wants = s.logprobs or s.top_logprobs > 0 or len(s.token_ids_logprob) > 0
        limit = s.max_new_tokens if s.HasField("max_new_tokens") else 4
        n = s.n or 1
        outputs: list[list[int]] = [[] for _ in range(n)]
        reasons = [(gen_pb.FINISH_REASON_LENGTH, "max_new_tokens")] * n
        for step in range(limit):
            for sample in range(n):
                if reasons[sample][0] == gen_pb.FINISH_REASON_STOP:
                    continue
                token = generated(prompt, sample, step)
                if token in s.stop_token_ids:
                    reasons[sample] = (gen_pb.FINISH_REASON_STOP, f"stop token {token}")
                    continue
                outputs[sample].append(token)
                chunk = gen_pb.TokenChunk(index=sample, token_ids=[token], text=piece(token))
                if wants:
                    chunk.logprobs.append(scored(len(prompt) + step, token, s))
                out.append(gen_pb.GenerateResponse(request_id=rid, chunk=chunk))
        for sample in range(n):
            usage = gen_pb.Usage(
                prompt_tokens=len(prompt), cached_tokens=0, completion_tokens=len(outputs[sample])
            )
            reason, message = reasons[sample]
            fin = gen_pb.Finished(index=sample, reason=reason, message=message, usage=usage)
            fin.timings.total_s = 0.5
            out.append(gen_pb.GenerateResponse(request_id=rid, finished=fin))
        return Call(out)

    def _scripted(self, request: gen_pb.GenerateRequest, text: str) -> Call:
        """`text` for each sample, a chunk of a few characters per token, then STOP (eos); LENGTH
        when max_new_tokens (in chunks) cuts it short."""
        s, rid = request.sampling, request.request_id
        pieces = [text[i : i + self.chunk_chars] for i in range(0, len(text), self.chunk_chars)]
        reason, message = self.scripted_finish
        if s.HasField("max_new_tokens") and s.max_new_tokens < len(pieces):
            pieces, reason, message = (
                pieces[: s.max_new_tokens],
                gen_pb.FINISH_REASON_LENGTH,
                "max_new_tokens",
            )
        out = []
        for sample in range(s.n or 1):
            for i, part in enumerate(pieces):
                token = 2 + (i % (VOCAB - 2))
                chunk = gen_pb.TokenChunk(index=sample, token_ids=[token], text=part)
                out.append(gen_pb.GenerateResponse(request_id=rid, chunk=chunk))
        for sample in range(s.n or 1):
            usage = gen_pb.Usage(prompt_tokens=10, completion_tokens=len(pieces))
            fin = gen_pb.Finished(index=sample, reason=reason, message=message, usage=usage)
            out.append(gen_pb.GenerateResponse(request_id=rid, finished=fin))
        return Call(out)

    async def server_info(
        self, *, api_key: str | None = None, timeout: float | None = None
    ) -> gen_pb.ServerInfo:
        self.asked.append(api_key)
        if self.keys is not None and api_key not in self.keys:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "missing or unknown API key",
            )
        return gen_pb.ServerInfo(
            model="fake", max_context=self.max_context, vocab_size=VOCAB, version="9.9.9"
        )

    async def close(self) -> None:
        pass


def app_with(
    plane: FakeControlPlane,
    template: ChatTemplate | None = None,
    tokenizer: bool = True,
    model_name: str = "fake",
):  # type: ignore[no-untyped-def]
    config = GatewayConfig("unused:1", model_name, template, tokenizer=plane.tokenizer if tokenizer else None)
    app = create_app(config)
    app.state.gateway._client = plane  # the lifespan would open a channel; the fake stands in
    return app


def http_client(app) -> httpx.AsyncClient:  # type: ignore[no-untyped-def]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=10)


def openai_client(app) -> openai.AsyncOpenAI:  # type: ignore[no-untyped-def]
    return openai.AsyncOpenAI(
        base_url="http://gateway/v1", api_key="unused", max_retries=0, http_client=http_client(app)
    )
