"""OpenAI response bodies built from the gRPC stream: completions and chat completions.

One Generate call serves all `n` choices of a prompt; chunks and Finished messages carry the
choice's index. A completions request with several prompts makes one call per prompt: its choices
are numbered `prompt_index * n + sample_index`, as OpenAI numbers them. Usage comes from the Finished
messages: each prompt once, the outputs summed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from clients.client import FINISH_NAMES
from gateway.errors import GatewayError
from protos.stepwise.v1 import generation_pb2 as gen_pb


@dataclass(slots=True)
class Choice:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0


@dataclass(slots=True)
class Collected:
    """The choices of one request, filled in response by response."""

    choices: list[Choice]
    n: int = 1
    # Per prompt, from its first Finished message: (prompt tokens, cached tokens).
    prompt_usage: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, n: int, prompts: int = 1) -> Collected:
        return cls([Choice() for _ in range(n * prompts)], n)

    @property
    def prompt_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.prompt_usage.values())

    @property
    def cached_tokens(self) -> int:
        return sum(cached for _, cached in self.prompt_usage.values())

    def apply(self, response: gen_pb.GenerateResponse, prompt: int = 0) -> tuple[int, str, str | None]:
        """Record one response of prompt `prompt`'s call; (choice index, new text, finish reason or
        None).

        An aborted choice (timeout, lost worker, shutdown) is a 503: OpenAI has no finish reason
        for it, and a truncated answer must not pass for a complete one.
        """
        offset = prompt * self.n
        if response.WhichOneof("event") == "chunk":
            chunk = response.chunk
            self.choices[offset + chunk.index].text += chunk.text
            return offset + chunk.index, chunk.text, None
        fin = response.finished
        if fin.reason == gen_pb.FINISH_REASON_ABORT:
            raise GatewayError(503, f"the generation was aborted: {fin.message}", code="aborted")
        choice = self.choices[offset + fin.index]
        choice.finish_reason = FINISH_NAMES.get(fin.reason, "stop")
        choice.completion_tokens = fin.usage.completion_tokens
        # A prompt's choices share it: count it (and its cache hits) once, from the first.
        self.prompt_usage.setdefault(prompt, (fin.usage.prompt_tokens, fin.usage.cached_tokens))
        return offset + fin.index, "", choice.finish_reason

    def usage(self) -> dict[str, Any]:
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class CompletionFormat:
    """`/v1/completions`: `text_completion` objects, streamed or whole."""

    prefix = "cmpl"

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        envelope = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return {**envelope, "choices": choices}

    def opening(self, n: int) -> list[dict[str, Any]]:
        """Chunks sent before any token (none for completions)."""
        return []

    def chunk(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, collected: Collected) -> dict[str, Any]:
        return {**self._envelope("text_completion", []), "usage": collected.usage()}

    def whole(self, collected: Collected) -> dict[str, Any]:
        choices = [
            {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            for i, c in enumerate(collected.choices)
        ]
        return {**self._envelope("text_completion", choices), "usage": collected.usage()}


class ChatFormat(CompletionFormat):
    """`/v1/chat/completions`: `chat.completion` and `chat.completion.chunk` objects."""

    prefix = "chatcmpl"

    def opening(self, n: int) -> list[dict[str, Any]]:
        # OpenAI opens each choice's stream with the role and empty content.
        return [self._delta(i, {"role": "assistant", "content": ""}, None) for i in range(n)]

    def _delta(self, index: int, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self._delta(index, {"content": text} if text else {}, finish_reason)

    def usage_chunk(self, collected: Collected) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": collected.usage()}

    def whole(self, collected: Collected) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(collected.choices)
        ]
        return {**self._envelope("chat.completion", choices), "usage": collected.usage()}
