"""What the gateway needs of a tokenizer.

The gateway tokenizes with the control plane's own tokenizer class, loaded from the same `--model`
directory (handed in by the command line: the gateway imports nothing of the control plane), so the
ids are those the control plane makes of the same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TokenCodec(Protocol):
    """Text to the model's token ids and back (`control_plane.tokenizer.Tokenizer`)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
