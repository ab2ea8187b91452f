"""The OpenAI request bodies the gateway accepts, and their translation to a GenerateRequest.

Unknown fields are ignored, as the OpenAI API's clients expect of a compatible server; fields whose
meaning the gRPC protocol cannot carry (log probabilities, echo, suffix, best_of) are refused with a
400 that names them rather than silently dropped.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clients.client import generate_request, sampling_params
from gateway.errors import GatewayError, invalid
from protos.stepwise.v1 import generation_pb2 as gen_pb

M = TypeVar("M", bound=BaseModel)
Role = Literal["system", "developer", "user", "assistant", "tool"]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    min_tokens: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int | None = None

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self) -> gen_pb.SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return sampling_params(
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            # OpenAI-style servers spell "no top-k filter" -1; the protocol spells it 0.
            top_k=None if self.top_k is None else max(self.top_k, 0),
            min_p=self.min_p,
            stop=stop,
            stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            n=self.n,
            min_new_tokens=self.min_tokens,
        )

    def grpc_request(self, prompt: str | list[int], request_id: str) -> gen_pb.GenerateRequest:
        return generate_request(prompt, self.sampling(), request_id, self.user or "", self.priority)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a list of one prompt counts); 400 for batches, which are not supported."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise invalid("prompt", f"{len(prompt)} prompts; this gateway takes one prompt per request")
            return prompt[0]  # type: ignore[return-value]
        return prompt  # type: ignore[return-value]

    def refuse_unsupported(self) -> None:
        if self.logprobs is not None:
            raise invalid("logprobs", "not supported: the Stepwise protocol carries no log probabilities")
        if self.echo:
            raise invalid("echo", "not supported")
        if self.suffix:
            raise invalid("suffix", "not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of", "not supported (only best_of = n)")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[TextPart] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template sees it: text parts joined into one string."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(part.text for part in self.content)
        data.setdefault("content", "")
        return data


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def refuse_unsupported(self) -> None:
        if self.logprobs or self.top_logprobs:
            param = "logprobs" if self.logprobs else "top_logprobs"
            raise invalid(param, "not supported: the Stepwise protocol carries no log probabilities")
        if self.max_completion_tokens is not None:
            # The newer name wins, as in OpenAI's API.
            self.max_tokens = self.max_completion_tokens


def parse_body(raw: bytes, model: type[M]) -> M:
    """The request body as `model`; a 400 naming the first bad field otherwise."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"] if not _is_union_branch(part)) or None
        got = f", got {first['input']!r}" if "input" in first and param else ""
        raise GatewayError(400, f"{param}: {first['msg']}{got}", param=param) from None


def _is_union_branch(part: object) -> bool:
    """Pydantic names the union branch it tried in the error location (`str`, `list[int]`)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)
