"""vLLM's `/tokenize` and `/detokenize` request bodies, and what the gateway needs of a tokenizer.

The gateway tokenizes with the control plane's own tokenizer class, loaded from the same `--model`
directory (handed in by the command line: the gateway imports nothing of the control plane), so the
ids are those the control plane makes of the same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import invalid
from gateway.limits import MAX_MESSAGES
from gateway.schemas import ChatMessage, Int32, Text, refuse_extra_fields


class TokenCodec(Protocol):
    """Text to the model's token ids and back (`control_plane.tokenizer.Tokenizer`)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TokenizeRequest(BaseModel):
    """`{"prompt": TEXT}` or `{"messages": [...], "add_generation_prompt": true}`."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    # The ids are those the control plane makes of the text: special tokens included.
    add_special_tokens: bool = True

    def refuse_unsupported(self) -> None:
        refuse_extra_fields(self)
        if (self.prompt is None) == (self.messages is None):
            raise invalid("prompt", "give either prompt or messages")
        if not self.add_special_tokens:
            raise invalid(
                "add_special_tokens",
                "not supported: the tokens are those the control plane makes of "
                "the prompt, special tokens included",
            )


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    tokens: list[Int32]

    def refuse_unsupported(self) -> None:
        refuse_extra_fields(self)

    def check_vocabulary(self, vocab_size: int) -> None:
        for i, token in enumerate(self.tokens):
            if not 0 <= token < vocab_size:
                raise invalid(f"tokens.{i}", f"token id {token} is outside the vocabulary [0, {vocab_size})")
