"""Chat templates rendered the way transformers' `apply_chat_template(tokenize=False)` renders them.

The template comes from the model directory (`chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template`), read with plain json and jinja2: importing transformers takes seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import GatewayError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A compiled template and the special tokens it may use as variables."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text; a template's `raise_exception` or error is a 400 naming `messages`.
        `tools`: OpenAI's tool objects, as transformers passes dicts (unchanged). `extra`: more
        variables (a request's chat_template_kwargs and documents, as transformers takes them)."""
        variables = {"documents": None, **(extra or {})}
        if variables["documents"] and "documents" not in self.source:
            # The template would render the prompt without them: the model would never see them.
            raise GatewayError(400, "documents: the chat template does not render documents", "documents")
        try:
            return _compile(self.source).render(
                **variables,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise GatewayError(400, f"messages: {exc}", param="messages") from None
        except Exception as exc:
            # The template runs on the caller's messages, extra fields included (a `tool_calls` that
            # is a string, a list nested a thousand deep): whatever it trips over, they brought.
            problem = f"messages: the chat template cannot render them: {type(exc).__name__}: {exc}"
            raise GatewayError(400, problem, param="messages") from None


def load_template(model_dir: Path, source: str | None = None) -> ChatTemplate | None:
    """The model's chat template, or None when it has none (chat completions then answer 400).
    `source`: another template to serve instead (--chat-template), with the model's special tokens."""
    config = _read_json(model_dir / "tokenizer_config.json")
    jinja_file = model_dir / "chat_template.jinja"
    if source is None:
        source = (
            jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else config.get("chat_template")
        )
    if isinstance(source, list):  # named templates: transformers uses the one named "default"
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not source:
        return None
    tokens = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name)}
    return ChatTemplate(source, tokens)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(token: str | dict[str, Any]) -> str:
    """A special token as saved: a string, or an AddedToken's dict with its `content`."""
    return token if isinstance(token, str) else str(token.get("content", ""))


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: unlike jinja2's own, it does not escape HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_COMPILED: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    """The environment transformers builds: sandboxed, trim_blocks and lstrip_blocks, loop controls."""
    if source not in _COMPILED:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _COMPILED[source] = env.from_string(source)
    return _COMPILED[source]
