"""OpenAI response bodies built from the gRPC stream: completions and chat completions.

One Generate call serves all `n` choices of a prompt; chunks and Finished messages carry the
choice's index. A completions request with several prompts makes one call per prompt: its choices
are numbered `prompt_index * n + sample_index`, as OpenAI numbers them. Usage comes from the Finished
messages: each prompt once, the outputs summed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clients.client import FINISH_NAMES
from gateway.errors import GatewayError
from gateway.logprobs import CompletionLogprobs, chat_content
from gateway.tools import OutputParser, Parsed, ToolPlan, assemble
from protos.stepwise.v1 import generation_pb2 as gen_pb


@dataclass(slots=True)
class Choice:
    text: str = ""
    finish_reason: str | None = None
    # The Finished message's detail (`eos`, `stop token 13`, `stop string '\n'`, `max_new_tokens`).
    finish_message: str = ""
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[gen_pb.TokenLogprob] = field(default_factory=list)
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Event:
    """What one response changed: choice `index` (-1 for a prompt's PromptLogprobs event) of prompt
    `prompt` got this text, these tokens and their log probabilities, or finished."""

    index: int
    prompt: int
    text: str = ""
    finish_reason: str | None = None
    token_ids: Sequence[int] = ()
    logprobs: Sequence[gen_pb.TokenLogprob] = ()


@dataclass(slots=True)
class Collected:
    """The choices of one request, filled in response by response."""

    choices: list[Choice]
    n: int = 1
    # Per prompt, from its first Finished message: (prompt tokens, cached tokens).
    prompt_usage: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Per prompt, its PromptLogprobs event (when the request asked for one).
    prompt_logprobs: dict[int, gen_pb.PromptLogprobs] = field(default_factory=dict)

    @classmethod
    def of(cls, n: int, prompts: int = 1) -> Collected:
        return cls([Choice() for _ in range(n * prompts)], n)

    @property
    def prompt_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.prompt_usage.values())

    @property
    def cached_tokens(self) -> int:
        return sum(cached for _, cached in self.prompt_usage.values())

    def prompt_of(self, index: int) -> int:
        return index // self.n

    def apply(self, response: gen_pb.GenerateResponse, prompt: int = 0) -> Event:
        """Record one response of prompt `prompt`'s call.

        An aborted choice (timeout, lost worker, shutdown) is a 503: OpenAI has no finish reason
        for it, and a truncated answer must not pass for a complete one.
        """
        offset = prompt * self.n
        kind = response.WhichOneof("event")
        if kind == "prompt_logprobs":
            self.prompt_logprobs[prompt] = response.prompt_logprobs
            return Event(-1, prompt)
        if kind == "chunk":
            chunk = response.chunk
            choice = self.choices[offset + chunk.index]
            choice.text += chunk.text
            choice.token_ids.extend(chunk.token_ids)
            choice.logprobs.extend(chunk.logprobs)
            return Event(offset + chunk.index, prompt, chunk.text, None, chunk.token_ids, chunk.logprobs)
        fin = response.finished
        if fin.reason == gen_pb.FINISH_REASON_ABORT:
            raise GatewayError(503, f"the generation was aborted: {fin.message}", code="aborted")
        choice = self.choices[offset + fin.index]
        choice.finish_reason = FINISH_NAMES.get(fin.reason, "stop")
        choice.finish_message = fin.message
        choice.completion_tokens = fin.usage.completion_tokens
        choice.total_s = fin.timings.total_s
        # A prompt's choices share it: count it (and its cache hits) once, from the first.
        self.prompt_usage.setdefault(prompt, (fin.usage.prompt_tokens, fin.usage.cached_tokens))
        return Event(offset + fin.index, prompt, "", choice.finish_reason)

    def usage(self) -> dict[str, Any]:
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class ResponseFormat:
    """How the collected choices become an HTTP answer: streamed events, or one body."""

    def opening(self, n: int) -> list[dict[str, Any]]:
        """Events sent before any token."""
        return []

    def events(self, event: Event, collected: Collected) -> list[dict[str, Any]]:
        """The events one response becomes (none for a response that changed nothing to send)."""
        raise NotImplementedError

    def closing(self, collected: Collected) -> list[dict[str, Any]]:
        """Events sent after the last choice finished, before `[DONE]`."""
        return []

    def annotated(self, data: dict[str, Any], collected: Collected) -> dict[str, Any]:
        """A streamed event as sent (CompletionFormat adds continuous usage)."""
        return data

    def whole(self, collected: Collected) -> Any:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Echo:
    """`echo`: each prompt's text goes before its choices' text; with log probabilities, the
    prompt's positions (from its PromptLogprobs event) before theirs."""

    # Per prompt, its text when the request gave it as text; None for token ids (their text comes
    # from the PromptLogprobs event, else from `decode`).
    texts: list[str | None]
    prompts: list[str | list[int]]
    decode: Callable[[list[int]], str] | None = None

    def text(self, prompt: int, collected: Collected) -> str:
        given = self.texts[prompt]
        if given is not None:
            return given
        scored = collected.prompt_logprobs.get(prompt)
        if scored is not None:
            return scored.text
        ids = self.prompts[prompt]
        assert self.decode is not None and isinstance(ids, list), "checked when the request came in"
        return self.decode(ids)


class CompletionFormat(ResponseFormat):
    """`/v1/completions`: `text_completion` objects, streamed or whole."""

    prefix = "cmpl"

    def __init__(
        self, model: str, include_usage: bool = False, logprobs: bool = False, echo: Echo | None = None
    ) -> None:
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.echo = echo
        # vLLM's continuous_usage_stats: each prompt's token count, for the usage on every chunk.
        self.prompt_counts: list[int] | None = None
        # Streaming: per choice, its log probabilities' running text offset; the choices already
        # opened (their echo sent).
        self._streamed: dict[int, CompletionLogprobs] = {}
        self._opened: set[int] = set()

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        envelope = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return {**envelope, "choices": choices}

    def _choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def events(self, event: Event, collected: Collected) -> list[dict[str, Any]]:
        if event.index < 0:
            return []
        text, logprobs = event.text, None
        if self.logprobs:
            builder = self._streamed.setdefault(event.index, CompletionLogprobs())
        if self.echo is not None and event.index not in self._opened:
            self._opened.add(event.index)
            text = self.echo.text(event.prompt, collected) + text
            scored = collected.prompt_logprobs.get(event.prompt)
            if self.logprobs and scored is not None:
                builder.add(scored.positions)
        if self.logprobs:
            builder.add(event.logprobs)
            if builder.tokens:
                logprobs = builder.take()
        if not (text or event.finish_reason or logprobs):
            return []
        return [
            self._envelope(
                "text_completion", [self._choice(event.index, text, logprobs, event.finish_reason)]
            )
        ]

    def closing(self, collected: Collected) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [{**self._envelope("text_completion", []), "usage": collected.usage()}]

    def annotated(self, data: dict[str, Any], collected: Collected) -> dict[str, Any]:
        """With continuous usage, a chunk of choice i carries vLLM's per-chunk usage: its prompt's
        tokens and the tokens choice i has generated so far."""
        if self.prompt_counts is None or not data["choices"]:
            return data
        index = data["choices"][0]["index"]
        choice = collected.choices[index]
        # The gateway's count until the control plane's own arrives (with the first Finished).
        counted = collected.prompt_usage.get(collected.prompt_of(index))
        prompt = counted[0] if counted is not None else self.prompt_counts[collected.prompt_of(index)]
        completion = max(len(choice.token_ids), choice.completion_tokens)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        return {**data, "usage": usage}

    def whole(self, collected: Collected) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(collected.choices):
            prompt = collected.prompt_of(i)
            text = c.text if self.echo is None else self.echo.text(prompt, collected) + c.text
            logprobs = None
            if self.logprobs:
                builder = CompletionLogprobs()
                scored = collected.prompt_logprobs.get(prompt)
                if self.echo is not None and scored is not None:
                    builder.add(scored.positions)
                builder.add(c.logprobs)
                logprobs = builder.body()
            choices.append(self._choice(i, text, logprobs, c.finish_reason))
        return {**self._envelope("text_completion", choices), "usage": collected.usage()}


class ChatFormat(CompletionFormat):
    """`/v1/chat/completions`: `chat.completion` and `chat.completion.chunk` objects. With tools
    (gateway/tools.py), each choice's text goes through the plan's output parser: content and
    `tool_calls`, and finish reason `tool_calls` for an answer that called a tool."""

    prefix = "chatcmpl"

    def __init__(
        self, model: str, include_usage: bool = False, logprobs: bool = False, tools: ToolPlan | None = None
    ) -> None:
        super().__init__(model, include_usage, logprobs)
        self.tools = tools
        # Streaming: per choice, its parser.
        self._parsers: dict[int, OutputParser] = {}

    def opening(self, n: int) -> list[dict[str, Any]]:
        # OpenAI opens each choice's stream with the role and empty content.
        return [self._delta(i, {"role": "assistant", "content": ""}, None, None) for i in range(n)]

    def _logprobs(self, positions: Sequence[gen_pb.TokenLogprob]) -> dict[str, Any] | None:
        return {"content": chat_content(positions), "refusal": None} if self.logprobs else None

    def _delta(
        self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk", [choice])

    def events(self, event: Event, collected: Collected) -> list[dict[str, Any]]:
        has_logprobs = self.logprobs and bool(event.logprobs)
        if event.index < 0 or not (event.text or event.finish_reason or has_logprobs):
            return []
        logprobs = self._logprobs(event.logprobs) if has_logprobs else None
        if self.tools is None:
            text = {"content": event.text} if event.text else {}
            return [self._delta(event.index, text, logprobs, event.finish_reason)]
        parser = self._parsers.setdefault(event.index, self.tools.output_parser())
        parsed = parser.feed(event.text) if event.text else Parsed()
        finish = event.finish_reason
        if finish is not None:
            parsed += parser.finish()
            finish = _tool_finish(finish, parser.called)
        out = []
        if parsed.content or parsed.calls or logprobs is not None:
            delta: dict[str, Any] = {"content": parsed.content} if parsed.content else {}
            if parsed.calls:
                delta["tool_calls"] = [call.body() for call in parsed.calls]
            out.append(self._delta(event.index, delta, logprobs, None))
        if finish is not None:
            out.append(self._delta(event.index, {}, None, finish))
        return out

    def closing(self, collected: Collected) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [{**self._envelope("chat.completion.chunk", []), "usage": collected.usage()}]

    def _message(self, choice: Choice) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish reason."""
        if self.tools is None:
            return {"role": "assistant", "content": choice.text}, choice.finish_reason
        parser = self.tools.output_parser()
        parsed = parser.feed(choice.text)
        parsed += parser.finish()
        if not parsed.calls:
            return {"role": "assistant", "content": parsed.content}, choice.finish_reason
        calls = assemble(parsed.calls)
        message = {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}
        reason = choice.finish_reason
        return message, None if reason is None else _tool_finish(reason, True)

    def whole(self, collected: Collected) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(collected.choices):
            message, finish_reason = self._message(c)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._logprobs(c.logprobs),
                    "finish_reason": finish_reason,
                }
            )
        return {**self._envelope("chat.completion", choices), "usage": collected.usage()}


def _tool_finish(reason: str, called: bool) -> str:
    """OpenAI's `tool_calls` for an answer that ended by itself with calls; a cut-off one stays
    `length`."""
    return "tool_calls" if called and reason == "stop" else reason
