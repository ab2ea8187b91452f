"""Log probabilities from the gRPC stream (`TokenLogprob`) in the shapes clients read them in:
OpenAI's completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), OpenAI's chat
(`content: [{token, logprob, bytes, top_logprobs}]`) and SGLang's (`[logprob, token_id, text]`).

JSON has no infinity: a log probability of -inf (a token the processed distribution filters out) is
written as -9999.0, the value OpenAI uses for "very unlikely".
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from protos.stepwise.v1 import generation_pb2 as gen_pb

VERY_UNLIKELY = -9999.0


def finite(logprob: float) -> float:
    """A log probability JSON can carry."""
    return logprob if math.isfinite(logprob) else VERY_UNLIKELY


def logprob_of(position: gen_pb.TokenLogprob) -> float | None:
    """The position's own log probability; None at the first scored prompt position."""
    return finite(position.logprob) if position.HasField("logprob") else None


class CompletionLogprobs:
    """OpenAI's completions `logprobs` object, filled position by position.

    `text_offset` counts characters: each token's offset is the sum of the lengths of the token
    texts before it, from the start of the returned text (the echoed prompt included)."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.offset = 0

    def add(self, positions: Iterable[gen_pb.TokenLogprob]) -> None:
        for position in positions:
            logprob = logprob_of(position)
            self.tokens.append(position.token)
            self.token_logprobs.append(logprob)
            self.top_logprobs.append(None if logprob is None else top_dict(position))
            self.text_offset.append(self.offset)
            self.offset += len(position.token)

    def body(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }

    def take(self) -> dict[str, Any]:
        """The positions added since the last take (a stream chunk's), the offset running on."""
        body = self.body()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return body


def top_dict(position: gen_pb.TokenLogprob) -> dict[str, float]:
    """`{token text: logprob}`, most likely first; of two alternatives with the same text (two ids
    that decode alike), the more likely one."""
    top: dict[str, float] = {}
    for token, logprob in zip(position.top_tokens, position.top_logprobs, strict=False):
        top.setdefault(token, finite(logprob))
    return top


def _token(token: str, logprob: float) -> dict[str, Any]:
    """The token's UTF-8 bytes are those of its text as decoded alone: an incomplete UTF-8 sequence
    there is U+FFFD's bytes, not the sequence's own."""
    return {"token": token, "logprob": finite(logprob), "bytes": list(token.encode("utf-8"))}


def chat_content(positions: Iterable[gen_pb.TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content` entries, one per output token."""
    return [
        {
            **_token(p.token, p.logprob),
            "top_logprobs": [_token(t, lp) for t, lp in zip(p.top_tokens, p.top_logprobs, strict=False)],
        }
        for p in positions
    ]


def sglang_token(position: gen_pb.TokenLogprob, with_text: bool) -> list[Any]:
    """SGLang's `[logprob, token_id, text]` (text None unless `return_text_in_logprobs`)."""
    return [logprob_of(position), position.token_id, position.token if with_text else None]


def sglang_top(position: gen_pb.TokenLogprob, with_text: bool) -> list[list[Any]] | None:
    """SGLang's top alternatives at one position; None where there are none (the first prompt
    position), as SGLang writes it."""
    if not position.top_ids:
        return None
    return [
        [finite(lp), token_id, text if with_text else None]
        for lp, token_id, text in zip(
            position.top_logprobs, position.top_ids, position.top_tokens, strict=False
        )
    ]


def sglang_ids(
    position: gen_pb.TokenLogprob, ids: list[int], with_text: bool, decode: Any
) -> list[Any] | None:
    """SGLang's `token_ids_logprob` entries at one position: `[logprob, id, text]` per asked id, in
    its order; None where there are none (the first prompt position)."""
    if not position.ids_logprobs:
        return None
    return [
        [finite(lp), token_id, decode(token_id) if with_text else None]
        for lp, token_id in zip(position.ids_logprobs, ids, strict=False)
    ]
