"""The OpenAI request bodies the gateway accepts, and their translation to a GenerateRequest.

Nothing a caller asks for is silently dropped. A field the gateway does not implement (OpenAI's
`audio`, `web_search_options`, ..., or any other name) is a 400 that names it, unless its
value asks for nothing: null, false, an empty list or object, or the documented no-op values in
NO_OP_VALUES. Fields whose meaning the gRPC protocol cannot carry (suffix, best_of other than n)
are refused the same way. Output constraints (gateway/structured.py) and tools (gateway/tools.py)
have modules of their own.
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError
from pydantic_core import ErrorDetails

from clients.client import generate_request, sampling_params
from flagtypes import INT32_MAX, INT32_MIN, UINT64_MAX
from gateway import limits
from gateway.chat import SPECIAL_TOKENS
from gateway.errors import GatewayError, invalid
from gateway.structured import Constraint, ConstraintFields, one_constraint, refuse_with_ignore_eos
from gateway.text import Text
from gateway.tools import ParserName, Tool, ToolPlan, plan_tools, template_arguments
from grammars import nesting
from protos.stepwise.v1 import generation_pb2 as gen_pb

M = TypeVar("M", bound=BaseModel)
Role = Literal["system", "developer", "user", "assistant", "tool"]

# What the gateway itself passes a chat template (gateway/chat.py): chat_template_kwargs cannot.
TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "raise_exception", "strftime_now"}
    | set(SPECIAL_TOKENS)
)
# Levels a body may nest: a schema's own (nesting.MAX_DEPTH), and room for the body's around it
# (`tools.0.function.parameters`).
BODY_DEPTH = nesting.MAX_DEPTH + 8

# Prompts of one completions request (each its own Generate call).
MAX_PROMPTS = limits.MAX_PROMPTS


# The protocol's field widths: past them protobuf refuses the value, so the schema must first.
Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
# Counted lists, refused past the control plane's limits as they are validated.
StopStrings = Annotated[list[Text], Field(max_length=limits.MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[Int32], Field(max_length=limits.MAX_STOP_TOKEN_IDS)]


# Unimplemented fields accepted at these values (and at null, false, [] and {}): they ask for what
# the gateway does anyway.
NO_OP_VALUES: dict[str, tuple[object, ...]] = {
    # On completions, which take no tools.
    "tool_choice": ("none",),
    "parallel_tool_calls": (True,),
    "modalities": (["text"],),
    "service_tier": ("auto", "default"),
    # vLLM's, at its defaults: the text never holds special tokens, and so no spaces between them.
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    # SGLang's, at its defaults: reasoning is split out only with a reasoning parser, which the
    # gateway does not have (nor does SGLang without --reasoning-parser).
    "separate_reasoning": (True,),
    "stream_reasoning": (True,),
}


def refuse_extra_fields(model: BaseModel, prefix: str = "") -> None:
    """A 400 naming the first field of `model` (a model with extra="allow") that the gateway does not
    implement and whose value asks for something."""
    for name, value in (model.model_extra or {}).items():
        if value in (None, False, [], {}) or value in NO_OP_VALUES.get(name, ()):
            continue
        raise invalid(f"{prefix}{name}", "not supported by this gateway")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False
    # vLLM's: usage (the tokens so far) on every chunk, besides include_usage's last event.
    continuous_usage_stats: bool = False


class SamplingFields(ConstraintFields):
    """What completions and chat completions share: sampling, and the output constraint fields."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    max_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    min_tokens: Count | None = None
    stop: Text | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=0, le=UINT64_MAX)
    n: int = Field(default=1, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    priority: Int32 | None = None
    # Stepwise's: the tenant (else `user` names it) and latency objectives (docs/protocols.md#tenants).
    tenant: Text | None = None
    ttft_slo_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    tpot_slo_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    # OpenAI's shape: token ids as JSON object keys (strings), biases in [-100, 100].
    logit_bias: dict[Text, float] | None = None
    # The constraint, once worked out (a tuple: None is an answer too).
    _constraint: tuple[Constraint | None] | None = PrivateAttr(default=None)

    def refuse_extra(self) -> None:
        check_stop_chars(self.stop, "stop")
        refuse_extra_fields(self)
        if self.stream_options is not None:
            refuse_extra_fields(self.stream_options, "stream_options.")
            options = self.stream_options
            if options.continuous_usage_stats and not options.include_usage:
                # vLLM ignores it then; asked for and not given, it is refused instead.
                raise invalid("stream_options.continuous_usage_stats", "needs include_usage: true")

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk (vLLM's `continuous_usage_stats`)."""
        return self.stream and self.include_usage() and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]

    def extra_constraints(self) -> list[Constraint | None]:
        """Constraints other fields ask for (chat: a tool choice that forces a call)."""
        return []

    def constraint(self) -> Constraint | None:
        """The one output constraint the request asks for, if any; a 400 naming both fields when
        it asks for two, or pairs one with ignore_eos."""
        if self._constraint is None:
            constraint = one_constraint([*self.constraints(), *self.extra_constraints()])
            refuse_with_ignore_eos(constraint, self.ignore_eos, "ignore_eos")
            self._constraint = (constraint,)
        return self._constraint[0]

    def renames(self) -> dict[str, str]:
        """The caller's names for the protocol fields a control plane's refusal may name."""
        constraint = self.constraint()
        return constraint.renames() if constraint is not None else {}

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
            logit_bias=self._logit_bias(),
        )

    def _logit_bias(self) -> dict[int, float] | None:
        """The bias map with integer token ids; the control plane checks ids and values."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise invalid("logit_bias", f"keys must be token ids, got {key!r}") from None
            if not INT32_MIN <= token <= INT32_MAX:
                raise invalid("logit_bias", f"token id {token} is out of range")
            biases[token] = value
        return biases

    def grpc_request(self, prompt: str | list[int], request_id: str) -> gen_pb.GenerateRequest:
        sampling = self.sampling()
        constraint = self.constraint()
        if constraint is not None:
            constraint.apply(sampling)
        self.ask_logprobs(sampling)
        req = generate_request(prompt, sampling, request_id, self.user or "", self.priority)
        req.tenant = self.tenant or self.user or ""
        req.ttft_slo_ms = self.ttft_slo_ms or 0.0
        req.tpot_slo_ms = self.tpot_slo_ms or 0.0
        return req

    def ask_logprobs(self, sampling: gen_pb.SamplingParams) -> None:
        """Set the log probability fields the request asks for (none here)."""

    def wants_logprobs(self) -> bool:
        return False


class CompletionRequest(SamplingFields):
    prompt: (
        Text
        | list[Int32]
        | Annotated[list[Text], Field(max_length=MAX_PROMPTS)]
        | Annotated[list[list[Int32]], Field(max_length=MAX_PROMPTS)]
    )
    # The sampled token's log probability and this many most likely alternatives per position
    # (the control plane refuses more than its --max-top-logprobs).
    logprobs: Count | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one text or token-id list, or a batch of them (one Generate call
        each, at most MAX_PROMPTS)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > MAX_PROMPTS:
                raise invalid("prompt", f"{len(prompt)} prompts; at most {MAX_PROMPTS} per request")
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def ask_logprobs(self, sampling: gen_pb.SamplingParams) -> None:
        if self.logprobs is None:
            return
        sampling.logprobs = True
        if self.logprobs:
            sampling.top_logprobs = self.logprobs
        if self.echo:
            # The whole prompt scored: its first position has no log probability.
            sampling.logprob_start_len = 0

    def refuse_unsupported(self) -> None:
        self.refuse_extra()
        self.constraint()
        if self.suffix:
            raise invalid("suffix", "not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of", "not supported (only best_of = n)")


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class CalledFunction(BaseModel):
    name: Text
    # OpenAI's JSON text; the template sees it parsed (gateway/tools.py, template_arguments).
    arguments: Text


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="allow")

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: Text | Annotated[list[TextPart], Field(max_length=limits.MAX_CONTENT_PARTS)] | None = None
    # An assistant's calls, and a tool message's answer to one of them.
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None

    def check(self, index: int) -> None:
        """A 400 naming the field for tool fields on the wrong role, or a tool result without the
        call it answers."""
        where = f"messages.{index}"
        if self.tool_calls and self.role != "assistant":
            raise invalid(f"{where}.tool_calls", f"only on assistant messages, not {self.role}")
        if self.role == "tool" and not self.tool_call_id:
            raise invalid(f"{where}.tool_call_id", "required on a tool message: the call it answers")
        for j, call in enumerate(self.tool_calls or []):
            refuse_extra_fields(call, f"{where}.tool_calls.{j}.")

    def template_dict(self, index: int = 0) -> dict[str, Any]:
        """The message as a chat template sees it: text parts joined into one string, tool call
        arguments as objects (transformers' convention)."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(part.text for part in self.content)
        data.setdefault("content", "")
        if self.tool_calls:
            data["tool_calls"] = [
                {
                    **call.model_dump(exclude_none=True),
                    "function": {
                        "name": call.function.name,
                        "arguments": template_arguments(
                            call.function.arguments, f"messages.{index}.tool_calls.{j}.function.arguments"
                        ),
                    },
                }
                for j, call in enumerate(self.tool_calls)
            ]
        return data


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=limits.MAX_MESSAGES)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    # OpenAI allows 0..20; the control plane refuses more than its --max-top-logprobs (20).
    top_logprobs: Count | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(default=None, max_length=limits.MAX_TOOLS)
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's and SGLang's: more variables for the chat template (`enable_thinking`, ...).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: documents for a RAG template (transformers' `documents`), each a dict of strings.
    documents: list[dict[str, Text]] | None = None
    # Worked out by plan(): what the tools come to.
    _tool_plan: ToolPlan | None = PrivateAttr(default=None)

    def wants_logprobs(self) -> bool:
        return self.logprobs

    def ask_logprobs(self, sampling: gen_pb.SamplingParams) -> None:
        if self.logprobs:
            sampling.logprobs = True
            if self.top_logprobs:
                sampling.top_logprobs = self.top_logprobs

    def refuse_unsupported(self, parser: ParserName = "hermes") -> None:
        """Everything a 400 can be for, before the prompt is rendered; `parser`: the gateway's
        --tool-call-parser, for tool_choice auto."""
        self.refuse_extra()
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        if self.max_completion_tokens is not None:
            # The newer name wins, as in OpenAI's API.
            self.max_tokens = self.max_completion_tokens
        for i, message in enumerate(self.messages):
            message.check(i)
        self._tool_plan = plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, parser)
        plan = self._tool_plan
        constraint = self.constraint()
        if (
            plan is not None
            and plan.mode == "auto"
            and constraint is not None
            and constraint is not plan.constraint
        ):
            # Held to the constraint, the model could never write a call: the tools would be dropped.
            raise invalid("tool_choice", f"auto cannot be combined with {constraint.field}")

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs; a 400 for one that would replace what the gateway passes."""
        kwargs = self.chat_template_kwargs or {}
        taken = sorted(set(kwargs) & TEMPLATE_VARIABLES)
        if taken:
            raise invalid(f"chat_template_kwargs.{taken[0]}", "set by the gateway from the request")
        return {**kwargs, "documents": self.documents} if self.documents else kwargs

    @property
    def tool_plan(self) -> ToolPlan | None:
        return self._tool_plan

    def tool_call_messages(self) -> list[int]:
        """The indices of the history's messages that hold tool calls."""
        return [i for i, message in enumerate(self.messages) if message.tool_calls]

    def extra_constraints(self) -> list[Constraint | None]:
        return [self._tool_plan.constraint if self._tool_plan is not None else None]


def check_stop_chars(stop: str | list[str] | None, field: str) -> None:
    """A 400 naming `field` for stop strings longer in all than the control plane takes."""
    strings = [stop] if isinstance(stop, str) else (stop or [])
    chars = sum(len(s) for s in strings)
    if chars > limits.MAX_STOP_CHARS:
        raise invalid(field, f"{chars} characters in all; at most {limits.MAX_STOP_CHARS}")


def parse_body(raw: bytes, model: type[M]) -> M:
    """The request body as `model`; a 400 naming the most specific bad field otherwise."""
    try:
        data = nesting.loads(raw, BODY_DEPTH)
    except nesting.TooDeep as exc:
        param = nesting.dotted("", exc.path) or None
        raise GatewayError(400, f"{param or 'the request body'}: {exc}", param=param) from None
    except ValueError as exc:  # bad JSON or UTF-8, or an integer of over 4,300 digits
        raise GatewayError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid_field(exc.errors()) from None


# An input is quoted in the message cut short (a few levels, a few items, a few dozen characters):
# a prompt can be megabytes, a list a thousand levels deep.
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlist, _QUOTE.maxdict = 3, 60, 60, 4, 4


def _invalid_field(errors: list[ErrorDetails]) -> GatewayError:
    """Of a union's errors, the branch that got furthest into the input says what is wrong
    (`prompt.0: must be <= 2147483647`, not `prompt: should be a valid string`); within one depth a
    bad value beats a wrong type. A list past its count beats them all: it is refused for its length
    whatever its items are."""
    error = max(
        errors, key=lambda e: (e["type"] == "too_long", len(_field_path(e)), not e["type"].endswith("_type"))
    )
    param = ".".join(_field_path(error)) or None
    got = f", got {_QUOTE.repr(error['input'])}" if "input" in error and param else ""
    return GatewayError(400, f"{param}: {error['msg']}{got}", param=param)


def _field_path(error: ErrorDetails) -> list[str]:
    return [str(part) for part in error["loc"] if not _is_union_branch(part)]


def _is_union_branch(part: object) -> bool:
    """Pydantic names the union branch it tried in the error location (`str`, `list[int]`)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)
