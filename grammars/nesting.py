"""How deep JSON may nest: in a request body, and in JSON given as text inside one of its fields (a
schema, a tool call's arguments).

Python's json reader and writer recurse, and fail with RecursionError past about a thousand levels
(fewer on a deep call stack); llguidance's JSON reader stops at 128. A bound checked up front turns
all of these into one refusal that names where the nesting is, before anything recurses on it.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Levels of arrays and objects, counting the outermost as one. A JSON Schema a model can follow
# nests a few dozen at most; 128 is also where llguidance's reader stops.
MAX_DEPTH = 128

# A string (escapes included) or one of the characters that open, close or separate JSON values.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},:]', re.DOTALL)


class TooDeep(ValueError):
    """JSON nested deeper than the bound; `path`: the keys and indexes down to where it is."""

    def __init__(self, path: tuple[str | int, ...], limit: int) -> None:
        super().__init__(f"nested deeper than {limit} levels")
        self.path = path


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """TooDeep when `value` (as json.loads makes it) nests arrays and objects deeper than `limit`.
    Iterative: a value a thousand levels deep is measured without recursing."""
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth > limit:
            raise TooDeep(path, limit)
        items = node.items() if type(node) is dict else enumerate(node)
        for key, child in items:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1, (*path, key)))


def loads(text: str | bytes, limit: int = MAX_DEPTH) -> Any:
    """json.loads, refusing nesting deeper than `limit` with TooDeep (never RecursionError);
    ValueError for text that is not JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        source = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise TooDeep(deep_path(source, limit), limit) from None
    if type(value) is dict or type(value) is list:
        check_depth(value, limit)
    return value


def deep_path(text: str, limit: int = MAX_DEPTH) -> tuple[str | int, ...]:
    """The keys and indexes down to the first container past `limit` levels in JSON text too deep
    for Python's reader; () when it is not found (the text is not JSON). Reads only as far as that
    container."""
    # One frame per open container: [is it an object, the key or index of the member being read,
    # whether a key comes next].
    frames: list[list[Any]] = []
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            if len(frames) >= limit:
                return tuple(frame[1] for frame in frames)
            frames.append([token == "{", None if token == "{" else 0, token == "{"])
        elif not frames:
            continue
        elif token in "]}":
            frames.pop()
        elif token == ",":
            frame = frames[-1]
            if frame[0]:
                frame[2] = True
            else:
                frame[1] += 1
        elif token != ":" and frames[-1][2]:
            frames[-1][1] = _key(token)
            frames[-1][2] = False
    return ()


def _key(token: str) -> str:
    try:
        return str(json.loads(token))
    except ValueError:
        return token


def dotted(prefix: str, path: tuple[str | int, ...], levels: int = 1) -> str:
    """`prefix` joined with the first `levels` parts of `path` (`messages.3`)."""
    parts = [prefix] if prefix else []
    parts += [str(part) for part in path[:levels]]
    return ".".join(parts)
