"""The llguidance backend (Microsoft's Rust grammar engine; the default).

llguidance compiles lazily: a matcher computes each mask from the grammar's lexer and parser
state on demand, so compiling is about a millisecond and a mask costs tens of microseconds per
row whatever the vocabulary. Regexes and JSON schemas are its own; GBNF is translated to its
Lark dialect; structural tags use its StructTag grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from grammars import gbnf
from grammars.spec import GrammarError, GrammarSpec, check_json, structural_tags

try:
    import llguidance
    from llguidance import LLMatcher, LLTokenizer
except ImportError:  # pragma: no cover - the backend is then reported as not installed
    llguidance = None  # type: ignore[assignment]

# JSON is written in one layout, Python's json.dumps default (", " and ": ", no other whitespace):
# with whitespace free, a weak model can fill a value's gaps with spaces until max_tokens. A
# schema's own "x-guidance" options override these.
JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = frozenset({"json_schema", "regex", "ebnf", "lark", "structural_tag"})
# Kinds whose first mask is checked at compile (`_check_first_mask`): a grammar's text can ask for
# nothing at all. A schema always allows some JSON, and its first matcher is what costs (3 s for
# 5,000 properties): the worker builds it, off its step.
PROBED = frozenset({"regex", "ebnf", "lark"})


def available() -> bool:
    return llguidance is not None


@dataclass(slots=True)
class Compiled:
    """llguidance's grammar text, and a fresh matcher of it once one was asked for: building a
    matcher takes milliseconds (6.5 ms for a 30-field schema at a 49k vocabulary), copying a
    fresh one about ten microseconds, so every matcher after the first is a copy."""

    grammar: str
    prototype: LLMatcher | None = None


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

    @property
    def failed(self) -> bool:
        matcher = self._matcher
        return bool(matcher.is_error() or (matcher.is_stopped() and not matcher.is_accepting()))


class Backend:
    name = "llguidance"
    kinds = KINDS

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._words = (vocab_size + 31) // 32
        self._eos = frozenset(eos_ids)
        self._tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
        self._executor = llguidance.LLExecutor()

    def compile(self, spec: GrammarSpec) -> Compiled:
        grammar = _grammar(spec, self._tokenizer)
        error = LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error and not error.startswith("WARNING"):
            raise GrammarError(_first_line(error))
        compiled = Compiled(grammar)
        if spec.kind in PROBED:
            self._check_first_mask(self._prototype(compiled))
        return compiled

    def _check_first_mask(self, prototype: LLMatcher) -> None:
        """GrammarError when the grammar's first mask shows it can never be satisfied (its matcher
        fails at once: `[^\\s\\S]`, a class of no character) or can only be empty (it allows
        nothing but EOS: no output token could ever be held to it)."""
        probe = prototype.deep_copy()
        words = np.zeros(self._words, dtype=np.int32)
        probe.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if probe.is_error():
            raise GrammarError(f"can never be satisfied: {_first_line(probe.get_error())}")
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
        if not set(allowed.tolist()) - self._eos:
            raise GrammarError("accepts only the empty output: no token could ever be generated under it")

    def fill_many(self, matchers: Sequence[Matcher], words: np.ndarray) -> None:
        """Fill row i of `words` from matchers[i], all in one call: llguidance's executor spreads
        the rows over its own threads (without the GIL), so a large batch's masks take a fraction
        of the time on a many-core host."""
        assert words.dtype == np.int32 and words.flags.c_contiguous and words.shape[0] >= len(matchers)
        pairs = [(m._matcher, i) for i, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, words.ctypes.data, self._words * 4, len(matchers))

    def matcher(self, compiled: Compiled) -> Matcher:  # type: ignore[override]
        return Matcher(self._prototype(compiled).deep_copy(), self._words)

    def _prototype(self, compiled: Compiled) -> LLMatcher:
        if compiled.prototype is None:
            prototype = LLMatcher(self._tokenizer, compiled.grammar, log_level=0)
            if prototype.is_error():
                raise GrammarError(_first_line(prototype.get_error()))
            compiled.prototype = prototype
        return compiled.prototype


def create(tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> Backend:
    return Backend(tokenizer_json, vocab_size, eos_ids)


def _grammar(spec: GrammarSpec, tokenizer: LLTokenizer) -> str:
    if spec.kind == "json_schema":
        check_json(spec.kind, spec.text)
        try:
            return str(LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_LAYOUT))
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
    if spec.kind == "regex":
        return str(LLMatcher.grammar_from_regex(spec.text))
    if spec.kind == "lark":
        return str(LLMatcher.grammar_from_lark(spec.text))
    if spec.kind == "ebnf":
        return str(LLMatcher.grammar_from_lark(gbnf.to_lark(spec.text)))
    return _structural_tag(spec.text, tokenizer)


def _structural_tag(text: str, tokenizer: LLTokenizer) -> str:
    """SGLang's structural tag as an llguidance grammar: free text, where each trigger starts a
    section held to its schema. Triggers are matched as special tokens when every one of them is
    one in this vocabulary (`<|python_tag|>`), else as text (`<tool_call>` in most vocabularies)."""
    tags, _ = structural_tags(text)
    return str(
        llguidance.StructTag.to_grammar(
            assume_special=all(_is_special(tokenizer, tag.trigger) for tag in tags),
            tags=[
                llguidance.StructTag(
                    trigger=tag.trigger,
                    begin=tag.begin,
                    # The schema itself (to_grammar embeds it with %json), with our JSON layout
                    # as its options unless it sets its own.
                    grammar={"x-guidance": JSON_LAYOUT, **tag.schema},
                    end=tag.end,
                )
                for tag in tags
            ],
        )
    )


def _is_special(tokenizer: LLTokenizer, text: str) -> bool:
    ids = tokenizer.tokenize_str(text)
    return len(ids) == 1 and tokenizer.is_special_token(ids[0])


def _first_line(message: str) -> str:
    """llguidance's message in one line: its first, and the regex parser's "error:" line if any
    (the lines between draw a caret under the grammar's text)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid grammar"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return lines[0] if detail is None else f"{lines[0].rstrip(':')}: {detail.removeprefix('error:').strip()}"
