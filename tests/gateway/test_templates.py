"""Shipped chat templates (gateway/templates.py) and how a model's template is chosen
(stepwise.models.chat_template): --chat-template NAME or FILE, else a named model's tools template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.chat import load_template
from gateway.templates import NAMED, template_source
from gateway.tools import PARSER_NAMES, default_parser
from stepwise.models import chat_template, resolve_model

PLAIN = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ROUND_TRIP: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


@pytest.mark.timeout(120)
def test_smollm2_serves_a_tools_template_that_renders_plain_chats_as_its_own() -> None:
    from transformers import AutoTokenizer

    smol = resolve_model("smollm2")
    served, own = chat_template("smollm2", smol), load_template(smol)
    assert served is not None and own is not None
    assert "tools" not in own.source and served.source == template_source("smollm2-tools")
    for messages in PLAIN:
        for generation_prompt in (True, False):
            assert served.render(messages, generation_prompt) == own.render(messages, generation_prompt)
    # With tools and a tool round trip it renders as transformers renders the same template.
    hf = AutoTokenizer.from_pretrained(str(smol))
    want = hf.apply_chat_template(
        ROUND_TRIP, tools=TOOLS, chat_template=served.source, tokenize=False, add_generation_prompt=True
    )
    got = served.render(ROUND_TRIP, True, TOOLS)
    assert got == want
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in got
    assert "<tool_response>\nsunny\n</tool_response>" in got
    # What it teaches is what the default parser reads.
    assert default_parser(served.source) == "hermes"


def test_the_flag_wins_and_takes_a_name_or_a_file(tmp_path: Path) -> None:
    embedded = resolve_model("embedded")
    for name in NAMED:
        chosen = chat_template("embedded", embedded, name)
        assert chosen is not None and chosen.source == template_source(name)
        assert chosen.special_tokens == load_template(embedded).special_tokens  # type: ignore[union-attr]
    mine = tmp_path / "mine.jinja"
    mine.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    chosen = chat_template("smollm2", resolve_model("smollm2"), str(mine))
    assert chosen is not None and chosen.render([{"role": "user", "content": "x"}]) == "[x]"
    with pytest.raises(ValueError, match="neither a file nor a shipped template"):
        chat_template("embedded", embedded, "no-such-template")


def test_the_parser_takes_vllms_and_sglangs_names() -> None:
    assert {name: PARSER_NAMES[name] for name in ("hermes", "llama3_json", "llama3-json")} == {
        "hermes": "hermes",
        "llama3_json": "llama3",
        "llama3-json": "llama3",
    }
