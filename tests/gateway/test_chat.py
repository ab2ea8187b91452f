"""Chat templates: ours renders what transformers' apply_chat_template renders, without transformers."""

from __future__ import annotations

import pathlib

import pytest

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


def test_raise_exception_is_a_400_naming_messages() -> None:
    template = load_template(resolve_model("embedded"))
    assert template is not None
    with pytest.raises(GatewayError) as err:
        template.render([{"role": "tool", "content": "x"}])
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
