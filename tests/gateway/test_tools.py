"""Tool calling on chat completions (gateway/tools.py): what reaches the template and the control
plane, how the output is read into tool calls, whole and streamed, and every refusal (a fake control
plane that answers scripted text: tests/gateway/fake.py)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from gateway.chat import ChatTemplate, load_template
from gateway.tools import (
    HermesParser,
    Llama3Parser,
    NamedParser,
    OutputParser,
    Parsed,
    RequiredParser,
    assemble,
    default_parser,
)
from stepwise.models import resolve_model
from tests.gateway.fake import FakeControlPlane, app_with, http_client, openai_client

pytestmark = pytest.mark.timeout(60)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "now"}},
]
NAMES = ("get_weather", "now")
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
EMBEDDED = load_template(resolve_model("embedded"))


@pytest.fixture
def plane() -> FakeControlPlane:
    return FakeControlPlane()


def app(plane: FakeControlPlane, template: ChatTemplate | None = EMBEDDED, **config: Any):  # type: ignore[no-untyped-def]
    application = app_with(plane, template)
    if config:
        import dataclasses

        gateway = application.state.gateway
        gateway.config = dataclasses.replace(gateway.config, **config)
    return application


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "tools": TOOLS, **fields}


def sent_schema(plane: FakeControlPlane) -> Any:
    sampling = plane.requests[-1].sampling
    assert sampling.WhichOneof("constraint") in (None, "json_schema")
    return json.loads(sampling.json_schema) if sampling.HasField("json_schema") else None


# --- the parsers --------------------------------------------------------------------------------


def parse_whole(parser: OutputParser, text: str) -> tuple[str, list[dict[str, Any]]]:
    parsed = parser.feed(text)
    parsed += parser.finish()
    return parsed.content, assemble(parsed.calls)


def parse_in_pieces(parser: OutputParser, text: str, size: int) -> tuple[str, list[dict[str, Any]]]:
    parsed = Parsed()
    for i in range(0, len(text), size):
        parsed += parser.feed(text[i : i + size])
    parsed += parser.finish()
    return parsed.content, assemble(parsed.calls)


def calls_of(result: tuple[str, list[dict[str, Any]]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result[1]]


HERMES = [
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        ' <tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}</tool_call>\n',
        "",
        [("now", {}), ("get_weather", {"city": "Oslo"})],
    ),
    ('Let me look. <tool_call>{"name": "now", "arguments": {}}</tool_call>', "Let me look.", [("now", {})]),
    # Qwen sometimes writes "parameters"; an unclosed block at the end is read as if closed.
    ('<tool_call>{"name": "now", "parameters": {}}', "", [("now", {})]),
    # Not a call: the text stays content as the model wrote it.
    ("Plain text < not a tag", "Plain text < not a tag", []),
    ("<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "now", "arguments": "x"}</tool_call>',
        '<tool_call>{"name": "now", "arguments": "x"}</tool_call>',
        [],
    ),
    ("ends with <tool_c", "ends with <tool_c", []),
    ("  \n", "  \n", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes_parser_whole_and_in_every_piece_size(text: str, content: str, calls: list[Any]) -> None:
    whole = parse_whole(HermesParser(NAMES), text)
    assert (whole[0], calls_of(whole)) == (content, calls)
    for size in range(1, 8):
        pieces = parse_in_pieces(HermesParser(NAMES), text, size)
        assert (pieces[0], calls_of(pieces)) == (content, calls), size
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in whole[1])


def test_hermes_parser_without_parallel_calls_keeps_the_first() -> None:
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>' * 2
    assert len(parse_whole(HermesParser(NAMES, parallel=False), text)[1]) == 1


LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "now", "parameters": {}}', "", [("now", {})]),
    (
        '{"name": "now", "parameters": {}}; {"name": "get_weather", "arguments": {"city": "Rome"}}',
        "",
        [("now", {}), ("get_weather", {"city": "Rome"})],
    ),
    ("The answer is 4.", "The answer is 4.", []),
    (
        '{"name": "now", "parameters": {}} and then some',
        '{"name": "now", "parameters": {}} and then some',
        [],
    ),
    ('{"answer": 4}', '{"answer": 4}', []),
    ('{"name": "now", "parameters": {', '{"name": "now", "parameters": {', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3)
def test_llama3_parser_whole_and_in_every_piece_size(text: str, content: str, calls: list[Any]) -> None:
    whole = parse_whole(Llama3Parser(NAMES), text)
    assert (whole[0], calls_of(whole)) == (content, calls)
    for size in range(1, 8):
        pieces = parse_in_pieces(Llama3Parser(NAMES), text, size)
        assert (pieces[0], calls_of(pieces)) == (content, calls), size


def test_required_parser_reads_each_element_as_it_closes() -> None:
    parser = RequiredParser(NAMES)
    first = parser.feed('[{"name": "get_weather", "parameters": {"city": "a}\\"b"}}, {"na')
    assert [(d.index, d.name, json.loads(d.arguments)) for d in first.calls] == [
        (0, "get_weather", {"city": 'a}"b'})
    ]
    second = parser.feed('me": "now", "parameters": {}}]')
    assert [(d.index, d.name, d.arguments) for d in second.calls] == [(1, "now", "{}")]
    assert parser.finish().content == ""
    # Cut short: the calls read so far, the rest as content.
    cut = RequiredParser(NAMES)
    content, calls = parse_whole(cut, '[{"name": "now", "parameters": {}}, {"name": "get_we')
    assert len(calls) == 1 and content == ', {"name": "get_we'


def test_named_parser_streams_the_arguments() -> None:
    parser = NamedParser("get_weather")
    first = parser.feed('{"ci')
    assert [d.body() for d in first.calls] == [
        {
            "index": 0,
            "id": first.calls[0].id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": '{"ci'}},
    ]
    assert [d.body() for d in parser.feed('ty": "x"}').calls] == [
        {"index": 0, "function": {"arguments": 'ty": "x"}'}}
    ]
    assert parser.finish().calls == []


def test_the_default_parser_is_the_templates_format() -> None:
    assert EMBEDDED is not None and default_parser(EMBEDDED.source) == "hermes"
    assert default_parser("{{ '<|python_tag|>' }}{{ tools }}") == "llama3"
    assert default_parser('Respond as {"name": function name, "parameters": ...}') == "llama3"
    assert default_parser("{{ messages }}") == "hermes"


# --- what is sent -------------------------------------------------------------------------------


async def test_auto_offers_the_tools_in_the_prompt_and_constrains_nothing(plane: FakeControlPlane) -> None:
    async with http_client(app(plane)) as http:
        reply = await http.post("/v1/chat/completions", json=chat())
        assert reply.status_code == 200, reply.text
        prompt = plane.requests[-1].text
        assert "<tools>\n" + json.dumps(TOOLS[0]) in prompt and sent_schema(plane) is None
        # none: the tools are not offered; plain text.
        reply = await http.post("/v1/chat/completions", json=chat(tool_choice="none"))
        assert reply.status_code == 200 and "<tools>" not in plane.requests[-1].text
        assert sent_schema(plane) is None and "tool_calls" not in reply.json()["choices"][0]["message"]


async def test_required_sends_an_array_of_calls_schema(plane: FakeControlPlane) -> None:
    async with http_client(app(plane)) as http:
        reply = await http.post("/v1/chat/completions", json=chat(tool_choice="required"))
        assert reply.status_code == 200, reply.text
        schema = sent_schema(plane)
        assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
        branches = schema["items"]["anyOf"]
        assert [b["properties"]["name"] for b in branches] == [
            {"type": "string", "enum": ["get_weather"]},
            {"type": "string", "enum": ["now"]},
        ]
        assert branches[0]["properties"]["parameters"] == WEATHER
        assert branches[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
        assert all(
            b["required"] == ["name", "parameters"] and b["additionalProperties"] is False for b in branches
        )
        await http.post("/v1/chat/completions", json=chat(tool_choice="required", parallel_tool_calls=False))
        assert sent_schema(plane)["maxItems"] == 1


async def test_a_named_tool_sends_its_parameter_schema(plane: FakeControlPlane) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with http_client(app(plane)) as http:
        reply = await http.post("/v1/chat/completions", json=chat(tool_choice=named))
    assert reply.status_code == 200, reply.text
    assert sent_schema(plane) == WEATHER


async def test_a_tool_result_round_trip_is_rendered_by_the_template(plane: FakeControlPlane) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
    ]
    plane.reply = lambda request: "It is sunny."
    async with openai_client(app(plane)) as client:
        reply = await client.chat.completions.create(model="fake", messages=history, tools=TOOLS)  # type: ignore[arg-type]
    prompt = plane.requests[-1].text
    assert (
        'Assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert prompt.endswith("Tool: <tool_response>\nsunny\n</tool_response>\nAssistant:")
    assert reply.choices[0].message.content == "It is sunny." and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


# --- what comes back ----------------------------------------------------------------------------

HERMES_TWO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("tool_choice", "text", "expected"),
    [
        ("auto", HERMES_TWO, [("get_weather", {"city": "Paris"}), ("now", {})]),
        (
            "required",
            '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            '{"city": "Rome"}',
            [("get_weather", {"city": "Rome"})],
        ),
    ],
    ids=["auto", "required", "named"],
)
async def test_tool_calls_whole_and_streamed(
    plane: FakeControlPlane, tool_choice: Any, text: str, expected: list[tuple[str, Any]]
) -> None:
    plane.reply = lambda request: text
    async with openai_client(app(plane)) as client:
        whole = await client.chat.completions.create(
            model="fake", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice
        )  # type: ignore[arg-type]
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected  # type: ignore[union-attr]
        assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
        assert len({c.id for c in calls}) == len(calls)
        stream = await client.chat.completions.create(
            model="fake",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=tool_choice,
            stream=True,  # type: ignore[arg-type]
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    by_index: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = by_index.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id is not None:
                assert call["id"] is None, "a call's id is sent once"
                call["id"], call["name"] = delta.id, delta.function.name  # type: ignore[union-attr]
                assert delta.type == "function"
            call["arguments"] += delta.function.arguments or ""  # type: ignore[union-attr]
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(by_index.items())] == expected
    assert all(c["id"].startswith("call_") for c in by_index.values())
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


async def test_named_streams_argument_fragments_after_an_opening_delta(plane: FakeControlPlane) -> None:
    plane.reply = lambda request: '{"city": "Rome"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with http_client(app(plane)) as http:
        reply = await http.post("/v1/chat/completions", json=chat(tool_choice=named, stream=True))
    events = [json.loads(line[6:]) for line in reply.text.split("\n\n") if line.startswith("data: {")]
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"].startswith(
        "call_"
    )
    assert len(deltas) > 2 and all(set(d) == {"index", "function"} for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Rome"}'


async def test_auto_with_text_and_a_call_and_the_llama3_parser(plane: FakeControlPlane) -> None:
    plane.reply = lambda request: 'Checking. <tool_call>{"name": "now", "arguments": {}}</tool_call>'
    async with openai_client(app(plane)) as client:
        reply = await client.chat.completions.create(model="fake", messages=MESSAGES, tools=TOOLS)  # type: ignore[arg-type]
    message = reply.choices[0].message
    assert message.content == "Checking." and [c.function.name for c in message.tool_calls or []] == ["now"]  # type: ignore[union-attr]
    plane.reply = lambda request: '{"name": "now", "parameters": {}}'
    async with openai_client(app(plane, tool_call_parser="llama3")) as client:
        reply = await client.chat.completions.create(model="fake", messages=MESSAGES, tools=TOOLS)  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in reply.choices[0].message.tool_calls or []] == ["now"]  # type: ignore[union-attr]


async def test_auto_with_a_strict_tool_holds_every_call_to_its_tool_and_leaves_text_free(
    plane: FakeControlPlane,
) -> None:
    """strict under auto: a structural tag (the text is free until `<tool_call>`, then the call is
    held to one of the tools, its arguments to that tool's schema), checked with the real backend."""
    import numpy as np

    from grammars import backend as grammar_backend
    from grammars.spec import GrammarSpec

    strict_tools = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    async with http_client(app(plane)) as http:
        reply = await http.post("/v1/chat/completions", json=chat(tools=strict_tools))
    assert reply.status_code == 200, reply.text
    sampling = plane.requests[-1].sampling
    assert sampling.WhichOneof("constraint") == "structural_tag"
    tokenizer = (resolve_model("embedded") / "tokenizer.json").read_text()
    backend = grammar_backend.create("llguidance", tokenizer, 1024, [0])
    compiled = backend.compile(GrammarSpec("structural_tag", sampling.structural_tag))
    import tokenizers

    tok = tokenizers.Tokenizer.from_str(tokenizer)

    def accepts(text: str) -> bool:
        matcher = backend.matcher(compiled)
        words = np.zeros(32, dtype=np.int32)
        for token in tok.encode(text, add_special_tokens=False).ids:
            matcher.fill(words)
            if not (int(words[token // 32]) >> (token % 32)) & 1:
                return False
            matcher.accept(token)
        return True

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts("Let me look. " + call)
    assert not accepts('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"town": 3}}')
    assert not accepts('<tool_call>\n{"name": "other", "arguments": {}}')


async def test_strict_under_auto_is_refused_where_calls_are_not_hermes_tags(plane: FakeControlPlane) -> None:
    strict_tools = [{"type": "function", "function": {"name": "a", "strict": True}}]
    async with http_client(app(plane, tool_call_parser="llama3")) as http:
        reply = await http.post("/v1/chat/completions", json=chat(tools=strict_tools))
    assert reply.status_code == 400
    assert "tools.0.function.strict" in reply.text and "hermes" in reply.text


async def test_a_cut_off_call_keeps_finish_reason_length(plane: FakeControlPlane) -> None:
    plane.reply = lambda request: '{"city": "Rome"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with http_client(app(plane)) as http:
        reply = await http.post("/v1/chat/completions", json=chat(tool_choice=named, max_tokens=2))
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    # Two tokens of three characters each (the fake's chunks): the arguments as far as they got.
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city'


async def test_n_choices_each_get_their_calls(plane: FakeControlPlane) -> None:
    plane.reply = lambda request: '[{"name": "now", "parameters": {}}]'
    async with http_client(app(plane)) as http:
        reply = await http.post("/v1/chat/completions", json=chat(tool_choice="required", n=2))
    choices = reply.json()["choices"]
    assert [c["message"]["tool_calls"][0]["function"]["name"] for c in choices] == ["now", "now"]
    assert choices[0]["message"]["tool_calls"][0]["id"] != choices[1]["message"]["tool_calls"][0]["id"]


# --- refusals -----------------------------------------------------------------------------------

NAMED_MISSING = {"type": "function", "function": {"name": "missing"}}
REFUSED = [
    (chat(tool_choice=NAMED_MISSING), "tool_choice", "not among the tools"),
    ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        {"messages": MESSAGES, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
        "",
    ),
    (chat(tool_choice="sometimes"), "tool_choice", ""),
    (chat(tool_choice={"type": "function"}), "tool_choice", ""),
    (chat(tool_choice={"type": "function", "function": {"name": "now", "x": 1}}), "tool_choice", "'x'"),
    ({"messages": MESSAGES, "tools": [TOOLS[1], TOOLS[1]]}, "tools.1.function.name", "names two tools"),
    ({"messages": MESSAGES, "tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type", ""),
    (
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools.0.function.name",
        "",
    ),
    (
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "a", "x": 1}}]},
        "tools.0.function.x",
        "",
    ),
    (
        chat(tool_choice="required", response_format={"type": "json_object"}),
        "tools",
        "cannot be combined with response_format",
    ),
    (
        chat(response_format={"type": "json_object"}),
        "tool_choice",
        "auto cannot be combined with response_format",
    ),
    (chat(tool_choice="required", regex="a"), "tools", "cannot be combined with regex"),
    (chat(tool_choice="required", ignore_eos=True), "ignore_eos", "cannot be combined with tools"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "required"),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                }
            ]
        },
        "messages.0.tool_calls",
        "only on assistant",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                }
            ]
        },
        "messages.0.tool_calls.0.function.arguments",
        "not valid JSON",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
        "messages.0.tool_calls.0.function.arguments",
        "",
    ),
]


@pytest.mark.parametrize(
    ("body", "param", "words"), REFUSED, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(REFUSED)]
)
async def test_bad_tool_requests_are_400s_naming_the_field(
    plane: FakeControlPlane, body: dict[str, Any], param: str, words: str
) -> None:
    async with http_client(app(plane)) as http:
        reply = await http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}:"), error
    assert words in error["message"], error
    assert not plane.requests


async def test_a_template_that_renders_no_tools_refuses_them(plane: FakeControlPlane) -> None:
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    async with http_client(app(plane, plain)) as http:
        reply = await http.post("/v1/chat/completions", json=chat())
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
        # tool_choice none offers nothing, so asks nothing of the template.
        assert (await http.post("/v1/chat/completions", json=chat(tool_choice="none"))).status_code == 200
        # required and named need no template: the grammar holds the output to a call.
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("required", named):
            answered = await http.post("/v1/chat/completions", json=chat(tool_choice=choice))
            assert answered.status_code == 200, answered.text
            assert answered.json()["choices"][0]["finish_reason"] in ("tool_calls", "length")


async def test_tool_calls_in_the_history_are_rendered_or_refused_by_name(plane: FakeControlPlane) -> None:
    """A template that never mentions tool_calls would render the assistant's call as an empty turn:
    a 400 naming the message, never a silently dropped call."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    async with http_client(app(plane, plain)) as http:
        reply = await http.post("/v1/chat/completions", json={"messages": history})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages.1.tool_calls"
    assert not plane.requests
    async with http_client(app(plane, EMBEDDED)) as http:
        assert (await http.post("/v1/chat/completions", json={"messages": history})).status_code == 200
    assert '"name": "get_weather"' in plane.requests[-1].text


@pytest.mark.parametrize(
    ("tool_choice", "param"),
    [
        ("required", "tools"),
        ({"type": "function", "function": {"name": "get_weather"}}, "tools.0.function.parameters"),
    ],
)
async def test_a_control_planes_refusal_of_the_schema_names_the_tools(
    plane: FakeControlPlane, tool_choice: Any, param: str
) -> None:
    plane.refuse_with = "sampling.json_schema: unsupported keyword"
    async with openai_client(app(plane)) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(
                model="fake", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice
            )  # type: ignore[arg-type]
    assert err.value.body["param"] == param  # type: ignore[index]


def test_every_combination_of_pieces_agrees_with_the_whole() -> None:
    """Two-piece splits at every point of every sample: streamed and whole never disagree."""
    for text, _, _ in HERMES:
        whole = parse_whole(HermesParser(NAMES), text)
        for cut in range(len(text) + 1):
            parser = HermesParser(NAMES)
            parsed = parser.feed(text[:cut])
            parsed += parser.feed(text[cut:])
            parsed += parser.finish()
            got = (parsed.content, assemble(parsed.calls))
            assert (got[0], calls_of(got)) == (whole[0], calls_of(whole)), (text, cut)
