"""Chat templates: ours renders what transformers' apply_chat_template renders, without transformers."""

from __future__ import annotations

import json
import pathlib

import pytest

import stepwise.embedded as embedded
from gateway.chat import ChatTemplate, load_template
from gateway.errors import GatewayError
from stepwise.models import resolve_model

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Tell me a story"},
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_embedded_template_renders_as_transformers_does(add_generation_prompt: bool) -> None:
    from transformers import AutoTokenizer

    model_dir = resolve_model("embedded")
    template = load_template(model_dir)
    assert template is not None
    expected = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(MESSAGES, add_generation_prompt) == expected


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
TOOL_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_system", [True, False])
def test_embedded_template_renders_tools_as_transformers_does(with_system: bool) -> None:
    from transformers import AutoTokenizer

    model_dir = resolve_model("embedded")
    template = load_template(model_dir)
    assert template is not None
    messages = TOOL_MESSAGES if with_system else TOOL_MESSAGES[1:]
    expected = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    rendered = template.render(messages, True, TOOLS)
    assert rendered == expected
    # Hermes/Qwen style: the tools inside <tools></tools>, the calls in <tool_call>, the results in
    # <tool_response>; the system text first.
    tools_section = "<tools>\n" + "\n".join(json.dumps(t) for t in TOOLS) + "\n</tools>"
    assert tools_section in rendered
    assert rendered.startswith("<|endoftext|>Be brief.\n\n# Tools") == with_system
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>'
        in rendered
    )
    assert 'Tool: <tool_response>\n{"sky": "clear"}\n</tool_response>\n' in rendered
    assert rendered.endswith("</tool_response>\nAssistant:")
    # Without tools nothing of this is rendered.
    assert "<tools>" not in template.render(MESSAGES)


def test_the_committed_template_is_the_builders() -> None:
    """`python -m stepwise.embedded build` writes CHAT_TEMPLATE as chat_template.jinja."""
    assert (embedded.EMBEDDED_DIR / "chat_template.jinja").read_text(
        encoding="utf-8"
    ) == embedded.CHAT_TEMPLATE


def test_raise_exception_is_a_400_naming_messages() -> None:
    template = load_template(resolve_model("embedded"))
    assert template is not None
    with pytest.raises(GatewayError) as err:
        template.render([{"role": "developer", "content": "x"}])
    assert err.value.status == 400 and err.value.param == "messages" and "unknown role" in err.value.message


def test_template_from_tokenizer_config_with_special_tokens(tmp_path: pathlib.Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{% endfor %}",'
        ' "bos_token": {"content": "<s>"}}'
    )
    template = load_template(tmp_path)
    assert template == ChatTemplate(template.source if template else "", {"bos_token": "<s>"})
    assert template is not None and template.render([{"role": "user", "content": "é<"}]) == '<s>"é<"'


def test_no_template(tmp_path: pathlib.Path) -> None:
    assert load_template(tmp_path) is None
