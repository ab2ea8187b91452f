"""Strings a protobuf message can hold: JSON may escape a lone surrogate (`"\\ud800"`), which no
UTF-8 string can, and protobuf would refuse it with a 500 after the request was accepted."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


def utf8_text(text: str) -> str:
    """A 400-worthy ValueError for a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid UTF-8: a lone surrogate at index {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(utf8_text)]
