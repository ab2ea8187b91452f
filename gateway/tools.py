"""Tool calling on chat completions: OpenAI's `tools` and `tool_choice`.

The tools reach the model through the chat template, as transformers' `apply_chat_template(tools=...)`
passes them (a list of `{"type": "function", "function": {...}}`). What the model makes of them
depends on `tool_choice`:

- `none`: the tools are not offered; plain text.
- `auto` (the default with tools): free generation, then the text is parsed for calls in the model
  family's format (`--tool-call-parser`: `hermes`, `<tool_call>{"name", "arguments"}</tool_call>`,
  or `llama3`, a bare `{"name", "parameters"}` object). A call that does not parse, or names a tool
  that was not offered, stays in the content as the model wrote it.
- `required`: the output is held by a JSON Schema to an array of one or more
  `{"name": TOOL, "parameters": ARGS}` (one `anyOf` branch per tool, ARGS that tool's schema).
- a named function: the output is held to that tool's parameter schema; it is the call's arguments.

The parsers are incremental (`feed` text as it streams, then `finish`), and a whole response is the
same parser fed once, so a streamed answer and a whole one always agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import invalid
from gateway.strict import closed
from gateway.structured import Constraint, refuse_asking_extras
from gateway.text import Text
from grammars import nesting

ParserName = Literal["hermes", "llama3"]
PARSERS: tuple[ParserName, ...] = ("hermes", "llama3")
# --tool-call-parser's spellings: vLLM's and SGLang's names for the two formats.
PARSER_NAMES: dict[str, ParserName] = {
    "hermes": "hermes",
    "llama3_json": "llama3",
    "llama3-json": "llama3",
    "llama3": "llama3",
}


def parser_name(flag: str) -> ParserName:
    """The format --tool-call-parser names (a KeyError for one argparse's choices let through)."""
    return PARSER_NAMES[flag]


# An empty parameter schema: a tool without `parameters` takes none.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    # OpenAI's rule for names; it also keeps a name safe to write inside a template's JSON.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def parameter_schema(self) -> dict[str, Any]:
        """The arguments' schema; with `strict: true` every object closed (gateway/strict.py)."""
        schema = self.parameters if self.parameters is not None else NO_PARAMETERS
        return closed(schema, "parameters") if self.strict else schema


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools and tool choice come to: the tools the template renders (none
    under `none`), how the output is read, and the constraint (required or named)."""

    tools: list[dict[str, Any]]
    mode: Literal["auto", "required", "named"]
    names: tuple[str, ...]
    parser: ParserName = "hermes"
    named: str = ""
    parallel: bool = True
    constraint: Constraint | None = None

    def output_parser(self) -> OutputParser:
        if self.mode == "named":
            return NamedParser(self.named)
        if self.mode == "required":
            return RequiredParser(self.names)
        if self.parser == "llama3":
            return Llama3Parser(self.names, self.parallel)
        return HermesParser(self.names, self.parallel)


def plan_tools(
    tools: list[Tool] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    parser: ParserName,
) -> ToolPlan | None:
    """The request's ToolPlan, None when no tool is offered; a 400 naming the field otherwise
    (a tool choice without tools, a named tool not among them, a duplicate name, ...)."""
    for i, tool in enumerate(tools or []):
        refuse_asking_extras(tool, f"tools.{i}.")
        refuse_asking_extras(tool.function, f"tools.{i}.function.")
    names = tuple(tool.function.name for tool in tools or [])
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools.{i}.function.name", f"{name!r} names two tools")
    choice, named = _choice(tool_choice, names)
    if choice == "none" or not names:
        return None
    parallel = parallel_tool_calls is not False
    rendered = [tool.model_dump(exclude_none=True) for tool in tools or []]
    by_name = {tool.function.name: tool.function for tool in tools or []}
    if choice == "auto":
        strict = [i for i, tool in enumerate(tools or []) if tool.function.strict]
        if strict and parser != "hermes":
            raise invalid(
                f"tools.{strict[0]}.function.strict",
                "true under tool_choice auto is enforced only in the hermes tool-call format "
                "(--tool-call-parser hermes); use tool_choice required or a named tool",
            )
        if strict:
            tag = Constraint("tools", "structural_tag", _json(hermes_calls_tag(by_name)))
            return ToolPlan(rendered, "auto", names, parser, "", parallel, tag)
    if choice == "named":
        schema = by_name[named].parameter_schema()
        where = f"tools.{names.index(named)}.function.parameters"
        constraint = Constraint("tool_choice", "json_schema", _json(schema), where)
        return ToolPlan(rendered, "named", names, parser, named, parallel, constraint)
    if choice == "required":
        constraint = Constraint("tools", "json_schema", _json(required_schema(by_name, parallel)))
        return ToolPlan(rendered, "required", names, parser, "", parallel, constraint)
    return ToolPlan(rendered, "auto", names, parser, "", parallel)


def _choice(tool_choice: str | dict[str, Any] | None, names: tuple[str, ...]) -> tuple[str, str]:
    """(`none`, `auto`, `required` or `named`, the named tool)."""
    if tool_choice is None:
        return ("auto" if names else "none"), ""
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise invalid("tool_choice", f"none, auto, required or a named function, got {tool_choice!r}")
        if tool_choice != "none" and not names:
            raise invalid("tool_choice", f"{tool_choice} needs tools")
        return tool_choice, ""
    function = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(function, dict):
        raise invalid("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
    extra = sorted(set(tool_choice) - {"type", "function"}) or sorted(set(function) - {"name"})
    if extra:
        raise invalid("tool_choice", f"{extra[0]!r}: not supported by this gateway")
    name = function.get("name")
    if name not in names:
        raise invalid("tool_choice", f"names the function {name!r}, which is not among the tools")
    return "named", str(name)


HERMES_TRIGGER = "<tool_call>"


def hermes_calls_tag(functions: dict[str, FunctionDefinition]) -> dict[str, Any]:
    """`tool_choice: auto` with a strict tool: free text, but every `<tool_call>` the model opens is
    held to one of the tools, its arguments to that tool's parameter schema (a structural tag: the
    grammar is free until the trigger, then a call in the template's layout)."""
    structures = [
        {
            "begin": f'{HERMES_TRIGGER}\n{{"name": {json.dumps(name)}, "arguments": ',
            "schema": f.parameter_schema(),
            "end": "}\n</tool_call>",
        }
        for name, f in functions.items()
    ]
    return {"structures": structures, "triggers": [HERMES_TRIGGER]}


def required_schema(functions: dict[str, FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """`tool_choice: required`: one or more calls, each `{"name", "parameters"}`, as an array."""
    branches = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": f.parameter_schema()},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, f in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def default_parser(template_source: str) -> ParserName:
    """The tool-call format a chat template teaches: Llama 3.1's templates say `<|python_tag|>`
    or ask for `"parameters"` without any `<tool_call>`; Hermes-style ones (Qwen, Hermes, the
    embedded model) wrap calls in `<tool_call>`. Hermes when the template says neither."""
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or '"parameters"' in template_source:
        return "llama3"
    return "hermes"


class ToolMessages(Protocol):
    """What check_renders_tools reads of a chat request."""

    @property
    def tool_plan(self) -> ToolPlan | None: ...

    def tool_call_messages(self) -> list[int]: ...


def check_renders_tools(template_source: str, body: ToolMessages) -> None:
    """A 400 naming the field a template would drop without a word: tools offered under
    `tool_choice: auto` (the model could not know of them, and no grammar makes it call one), or an
    assistant's `tool_calls` in the history. `required` and named choices need no template: the
    grammar holds the output to a call. (A template that never says `tools` / `tool_calls` cannot
    render them; `--chat-template hermes` can.)"""
    plan = body.tool_plan
    if plan is not None and plan.mode == "auto" and "tools" not in template_source:
        raise invalid(
            "tools",
            "the chat template does not render tools, so tool_choice auto could never call one (serve "
            "with --chat-template hermes, or ask for tool_choice required or a named tool)",
        )
    if "tool_calls" not in template_source:
        for index in body.tool_call_messages():
            raise invalid(
                f"messages.{index}.tool_calls",
                "the chat template does not render tool calls (serve with --chat-template hermes)",
            )


def template_arguments(raw: str, where: str) -> Any:
    """An assistant tool call's `arguments` (OpenAI's JSON text) as the object chat templates
    expect (transformers' convention; `| tojson` of the text would quote it)."""
    try:
        return nesting.loads(raw)
    except nesting.TooDeep as exc:
        raise invalid(where, str(exc)) from None
    except ValueError as exc:
        raise invalid(where, f"not valid JSON: {exc}") from None


# --- reading calls out of the output -----------------------------------------------------------


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class CallDelta:
    """A piece of tool call `index`: its opening (id and name) and/or a fragment of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            out.update(id=self.id, type="function")
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass(slots=True)
class Parsed:
    """What some output text came to: content for the caller, and tool call pieces."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


def assemble(deltas: list[CallDelta]) -> list[dict[str, Any]]:
    """OpenAI's `message.tool_calls` from the pieces, call by call."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        empty = {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        call = calls.setdefault(d.index, empty)
        if d.id is not None:
            call["id"] = d.id
        if d.name is not None:
            call["function"]["name"] = d.name
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


class OutputParser:
    """Feed the output as it comes; `finish` once it ends. `called`: whether any call was read."""

    def __init__(self) -> None:
        self.calls = 0
        # Whitespace held back: around tool calls it is layout, not content.
        self._space = ""

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        raise NotImplementedError

    def _call(self, name: str, arguments: str) -> CallDelta:
        delta = CallDelta(self.calls, call_id(), name, arguments)
        self.calls += 1
        return delta

    def _content(self, text: str) -> str:
        """Content to send now. Trailing whitespace waits for what follows it: before a call it is
        layout and is dropped (so a split anywhere in the text gives the same content)."""
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept) :]
        return kept

    def _rest(self) -> str:
        """At the end: held whitespace is content only in an answer without calls."""
        rest, self._space = self._space, ""
        return "" if self.called else rest


def _as_call(obj: Any, names: tuple[str, ...], argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed call object naming an offered tool; None otherwise."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if not isinstance(arguments, dict) or set(obj) - {"name", *argument_keys}:
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _loads(text: str) -> Any:
    """The model's JSON, or None (not JSON, or nested past what a call may hold)."""
    try:
        return nesting.loads(text)
    except ValueError:
        return None


class HermesParser(OutputParser):
    """Hermes and Qwen: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
    text around the blocks is content. A block that does not read as a call stays content as
    written; an unclosed block at the end is read as if closed."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: tuple[str, ...], parallel: bool = True) -> None:
        super().__init__()
        self.names, self.parallel = names, parallel
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        while True:
            if not self._inside:
                at = self._buffer.find(self.OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buffer, self.OPEN)
                    out.content += self._content(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out.content += self._content(self._buffer[:at])
                self._buffer, self._inside = self._buffer[at + len(self.OPEN) :], True
            at = self._buffer.find(self.CLOSE)
            if at < 0:
                return out
            out += self._block(self._buffer[:at], closed=True)
            self._buffer, self._inside = self._buffer[at + len(self.CLOSE) :], False

    def finish(self) -> Parsed:
        out = Parsed()
        if self._inside:
            out += self._block(self._buffer, closed=False)
        else:
            out.content += self._content(self._buffer)
        self._buffer, self._inside = "", False
        out.content += self._rest()
        return out

    def _block(self, inner: str, closed: bool) -> Parsed:
        call = _as_call(_loads(inner), self.names, ("arguments", "parameters"))
        if call is None:
            raw = self.OPEN + inner + (self.CLOSE if closed else "")
            return Parsed(self._content(raw))
        if self.called and not self.parallel:
            return Parsed()  # parallel_tool_calls false: the first call only
        return Parsed(calls=[self._call(*call)])


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could begin `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class Llama3Parser(OutputParser):
    """Llama 3.1/3.2's JSON tool calls: the whole output (after an optional `<|python_tag|>`) is one
    or more `{"name": ..., "parameters": {...}}` objects, separated by `;`. Anything else is content.
    Text that starts like a call is held until the end, when it is read whole."""

    TAG = "<|python_tag|>"

    def __init__(self, names: tuple[str, ...], parallel: bool = True) -> None:
        super().__init__()
        self.names, self.parallel = names, parallel
        self._buffer = ""
        self._mode: Literal["undecided", "content", "call"] = "undecided"

    def feed(self, text: str) -> Parsed:
        if self._mode == "content":
            return Parsed(self._content(text))
        self._buffer += text
        head = self._buffer.lstrip()
        if self._mode == "undecided":
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return Parsed()
            self._mode = "call" if head.removeprefix(self.TAG).lstrip()[:1] in ("{", "") else "content"
            if self._mode == "content":
                text, self._buffer = self._buffer, ""
                return Parsed(self._content(text))
        return Parsed()

    def finish(self) -> Parsed:
        text, self._buffer = self._buffer, ""
        out = Parsed()
        if self._mode == "call":
            calls = self._read(text.lstrip().removeprefix(self.TAG))
            if calls is None:
                out.content += self._content(text)
            else:
                out.calls += [self._call(*c) for c in (calls if self.parallel else calls[:1])]
        else:
            out.content += self._content(text)
        out.content += self._rest()
        return out

    def _read(self, text: str) -> list[tuple[str, str]] | None:
        decoder, at = json.JSONDecoder(), 0
        calls: list[tuple[str, str]] = []
        while True:
            while at < len(text) and (text[at].isspace() or (calls and text[at] == ";")):
                at += 1
            if at == len(text):
                return calls or None
            try:
                obj, at = decoder.raw_decode(text, at)
            except ValueError:
                return None
            call = _as_call(obj, self.names, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)


class RequiredParser(OutputParser):
    """`tool_choice: required`: the constrained output is `[{"name", "parameters"}, ...]`; each
    element becomes a call as soon as its closing brace arrives."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names
        self._text = ""
        self._scan = 0
        self._depth = 0
        self._string = self._escape = False
        self._start = -1
        self._done = 0  # the end of the last element read

    def feed(self, text: str) -> Parsed:
        self._text += text
        out = Parsed()
        for i in range(self._scan, len(self._text)):
            c = self._text[i]
            if self._string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._string = False
            elif c == '"':
                self._string = True
            elif c in "{[":
                if c == "{" and self._depth == 1:
                    self._start = i
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if c == "}" and self._depth == 1 and self._start >= 0:
                    out += self._element(self._text[self._start : i + 1])
                    self._start, self._done = -1, i + 1
        self._scan = len(self._text)
        return out

    def _element(self, text: str) -> Parsed:
        call = _as_call(_loads(text), self.names, ("parameters",))
        return Parsed(calls=[self._call(*call)]) if call is not None else Parsed(text)

    def finish(self) -> Parsed:
        """Cut short (finish reason length), the unfinished rest is content; an answer with no
        call at all is content whole."""
        rest = self._text if not self.called else self._text[self._done :]
        return Parsed("" if rest.strip(" \t\r\n,]") == "" and self.called else rest)


class NamedParser(OutputParser):
    """A named tool choice: the constrained output is the call's arguments, streamed as fragments
    after an opening delta with the id and name."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Parsed:
        if not text:
            return Parsed()
        if not self.called:
            opening = self._call(self.name, "")
            return Parsed(calls=[opening, CallDelta(0, arguments=text)])
        return Parsed(calls=[CallDelta(0, arguments=text)])

    def finish(self) -> Parsed:
        return Parsed() if self.called else Parsed(calls=[self._call(self.name, "")])
