"""The llguidance backend (Microsoft's Rust grammar engine; the default).

llguidance compiles lazily: a matcher computes each mask from the grammar's lexer and parser
state on demand, so compiling is about a millisecond and a mask costs tens of microseconds per
row whatever the vocabulary. Regexes and JSON schemas are its own; GBNF is translated to its
Lark dialect; structural tags use its StructTag grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from grammars.spec import GrammarError, GrammarSpec, check_json, structural_tags

try:
    import llguidance
    from llguidance import LLMatcher, LLTokenizer
except ImportError:  # pragma: no cover - the backend is then reported as not installed
    llguidance = None  # type: ignore[assignment]

KINDS = frozenset({"json_schema", "regex", "ebnf", "lark", "structural_tag"})


def available() -> bool:
    return llguidance is not None


@dataclass(frozen=True, slots=True)
class Compiled:
    """llguidance's grammar text (a matcher is built from it in about a millisecond)."""

    grammar: str


class Matcher:
    __slots__ = ("_bytes", "_matcher")

    def __init__(self, matcher: LLMatcher, words: int) -> None:
        self._matcher = matcher
        self._bytes = words * 4

    def fill(self, words: np.ndarray) -> None:
        assert words.dtype == np.int32 and words.flags.c_contiguous and words.nbytes == self._bytes
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, self._bytes)

    def accept(self, token: int) -> bool:
        return bool(self._matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_stopped())


class Backend:
    name = "llguidance"
    kinds = KINDS

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._words = (vocab_size + 31) // 32
        self._tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids) or None)

    def compile(self, spec: GrammarSpec) -> Compiled:
        grammar = _grammar(spec)
        error = LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error and not error.startswith("WARNING"):
            raise GrammarError(_first_line(error))
        return Compiled(grammar)

    def matcher(self, compiled: Compiled) -> Matcher:  # type: ignore[override]
        matcher = LLMatcher(self._tokenizer, compiled.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return Matcher(matcher, self._words)


def create(tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> Backend:
    return Backend(tokenizer_json, vocab_size, eos_ids)


def _grammar(spec: GrammarSpec) -> str:
    if spec.kind == "json_schema":
        check_json(spec.kind, spec.text)
        try:
            return str(LLMatcher.grammar_from_json_schema(spec.text))
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
    if spec.kind == "regex":
        return str(LLMatcher.grammar_from_regex(spec.text))
    if spec.kind == "lark":
        return str(LLMatcher.grammar_from_lark(spec.text))
    if spec.kind == "ebnf":
        try:
            lark = llguidance.gbnf_to_lark.gbnf_to_lark(spec.text)
        except Exception as exc:  # the translator raises plain exceptions on bad GBNF
            raise GrammarError(f"is not valid GBNF: {exc}") from None
        return str(LLMatcher.grammar_from_lark(lark))
    return _structural_tag(spec.text)


def _structural_tag(text: str) -> str:
    """SGLang's structural tag as an llguidance grammar: free text, where each trigger starts a
    section held to its schema."""
    tags, _ = structural_tags(text)
    return str(
        llguidance.StructTag.to_grammar(
            [
                llguidance.StructTag(trigger=tag.trigger, begin=tag.begin, grammar=tag.schema, end=tag.end)
                for tag in tags
            ]
        )
    )


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[0] if lines else "invalid grammar"
