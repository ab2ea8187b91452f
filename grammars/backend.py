"""The grammar backend interface, and the registry of backends by name.

A `Backend` is built once per process for one tokenizer (the vocabulary a mask covers, the EOS
ids a finished grammar allows); `compile` turns a GrammarSpec into the backend's compiled form
or raises GrammarError; `matcher` starts a fresh matcher on a compiled grammar. A `Matcher`
follows one sequence's output: `fill` writes the bitmask of the tokens allowed next, `accept`
advances by the token sampled (False: the token broke the grammar, and the matcher then allows
only EOS), `finished` says the grammar is complete and only EOS may follow. A backend may also offer
`fill_many` (BatchFiller), filling a whole step's masks in one call.

Backends are imported lazily, so a process that never constrains a request never loads one.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from grammars.spec import GrammarSpec

# Name -> module defining `create(tokenizer_json, vocab_size, eos_ids) -> Backend`.
_MODULES = {"llguidance": "grammars.llguidance_backend", "xgrammar": "grammars.xgrammar_backend"}
NAMES = tuple(_MODULES)
DEFAULT = "llguidance"
NONE = "none"


class Compiled(Protocol):
    """A backend's compiled grammar (opaque to callers)."""


class Matcher(Protocol):
    def fill(self, words: np.ndarray) -> None:
        """Write the allowed-next-token bitmask into `words` (int32, ceil(vocab / 32) of them)."""
        ...

    def accept(self, token: int) -> bool: ...

    @property
    def finished(self) -> bool: ...

    @property
    def failed(self) -> bool:
        """No token can go on and the grammar is not complete (a token was refused, or the
        backend's parser gave up): the output can no longer be a sentence of the grammar."""
        ...


class Backend(Protocol):
    name: str
    # The kinds of GrammarSpec this backend compiles.
    kinds: frozenset[str]

    def compile(self, spec: GrammarSpec) -> Compiled: ...

    def matcher(self, compiled: Compiled) -> Matcher: ...


@runtime_checkable
class BatchFiller(Protocol):
    """A backend that fills many matchers' masks in one call (`fill_many`; optional)."""

    def fill_many(self, matchers: Sequence[Matcher], words: np.ndarray) -> None: ...


def mask_words(vocab_size: int) -> int:
    """int32 words in one row's bitmask."""
    return (vocab_size + 31) // 32


def is_installed(name: str) -> bool:
    """Whether backend `name`'s library can be imported here."""
    try:
        module = importlib.import_module(_MODULES[name])
    except ImportError:
        return False
    return bool(module.available())


def installed() -> tuple[str, ...]:
    """The backends this process can run, in NAMES order."""
    return tuple(name for name in NAMES if is_installed(name))


def create(name: str, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> Backend:
    """Backend `name` for this tokenizer; ValueError naming it when unknown or not installed."""
    if name not in _MODULES:
        raise ValueError(f"unknown grammar backend {name!r} (one of {', '.join(NAMES)})")
    if not is_installed(name):
        raise ValueError(f"grammar backend {name!r} is not installed (pip install 'stepwise[{name}]')")
    module = importlib.import_module(_MODULES[name])
    backend: Backend = module.create(tokenizer_json, vocab_size, tuple(eos_ids))
    return backend
