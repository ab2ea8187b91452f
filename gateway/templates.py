"""Chat templates shipped with Stepwise, chosen by name with `--chat-template NAME` (a file path works
too), for models whose own template lacks what a client needs, as vLLM's and SGLang's
`--chat-template` do.

- `hermes`: ChatML (`<|im_start|>ROLE ... <|im_end|>`) with Hermes/Qwen tool calling: tools listed
  in the system turn, calls as `<tool_call>{"name", "arguments"}</tool_call>`, results as
  `<tool_response>` blocks (the `hermes` tool-call parser reads what it teaches).
- `smollm2-tools`: `hermes` opening a conversation without a system message with SmolLM2's own
  default one, so that a conversation without tools renders exactly as SmolLM2's template renders
  it. `--model smollm2` uses it by default: SmolLM2's template never mentions tools.
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# name -> (file in TEMPLATE_DIR, its default system message or None)
NAMED: dict[str, tuple[str, str | None]] = {
    "hermes": ("hermes.jinja", None),
    "smollm2-tools": ("hermes.jinja", SMOLLM2_SYSTEM),
}


def template_source(choice: str) -> str:
    """The source of `--chat-template CHOICE`: a shipped template's name, else a file's path (its
    text). ValueError naming the choices for neither."""
    named = NAMED.get(choice)
    if named is not None:
        file, system = named
        source = (TEMPLATE_DIR / file).read_text(encoding="utf-8")
        if system is None:
            return source
        return f"{{%- set default_system = {json.dumps(system)} -%}}\n{source}"
    path = Path(choice).expanduser()
    if not path.is_file():
        names = ", ".join(NAMED)
        raise ValueError(f"{choice!r} is neither a file nor a shipped template ({names})")
    return path.read_text(encoding="utf-8")
