"""The xgrammar backend (MLC's grammar engine; optional, `pip install 'stepwise[xgrammar]'`).

xgrammar compiles eagerly: compiling a grammar precomputes, per grammar position, which tokens
of the vocabulary are always or never allowed, so a compile costs milliseconds to seconds and
grows with the vocabulary, and a mask is then mostly a lookup. Its compiler keeps its own cache
of compiled grammars (bounded here, since schemas come from clients).

Importing xgrammar imports torch and transformers (its matcher module and its Hugging Face
helpers do), seconds of start-up, so this module imports it only when a backend is created;
`available()` only looks for it. The tokenizer information is built from the tokenizer.json
text with the `tokenizers` library, not from a transformers tokenizer: the vocabulary by id
(special added tokens blanked, so no grammar can emit them), padded with blanks to the model's
logits width, and the vocabulary's encoding read from the decoder.

Lark grammars are not offered: xgrammar's Lark dialect is not llguidance's (no %json, lexer
rules differ), so one text would mean different things on the two backends.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from grammars.spec import GrammarError, GrammarSpec, check_json, structural_tags

KINDS = frozenset({"json_schema", "regex", "ebnf", "structural_tag"})
# The compiler's cache of compiled grammars; client schemas are unbounded in number, so is not it.
CACHE_LIMIT_BYTES = 64 * 2**20
# xgrammar's messages start with a timestamp and a C++ source position, and failed checks with
# the check's expression; neither helps the client.
_NOISE = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*(Check failed:.*? is false:\s*)?")


def available() -> bool:
    """Whether xgrammar and its native runtime are installed. Found, not imported: importing it
    would load torch, and a process that lists backends should not pay that."""
    return all(importlib.util.find_spec(name) is not None for name in ("xgrammar", "tvm_ffi"))


@dataclass(frozen=True, slots=True)
class Compiled:
    """xgrammar's CompiledGrammar (its token-mask tables; matchers share it)."""

    grammar: Any


class Matcher:
    """One sequence's xgrammar matcher, with the two states the interface needs that xgrammar
    leaves to its caller: after a refused token it allows only EOS (xgrammar keeps its old state
    and would go on allowing the grammar), and after EOS it fills an EOS-only mask (xgrammar
    raises). `finished` means only EOS may follow; xgrammar says only whether the text so far is
    complete, so a complete matcher's mask is computed once to see whether anything else is
    allowed, and kept for the next `fill`."""

    __slots__ = ("_broken", "_eos_only", "_matcher", "_scratch", "_scratch_valid")

    def __init__(self, matcher: Any, eos_only: np.ndarray) -> None:
        self._matcher = matcher
        self._eos_only = eos_only
        self._broken = False
        self._scratch = np.empty_like(eos_only)
        self._scratch_valid = False

    def fill(self, words: np.ndarray) -> None:
        assert words.dtype == np.int32 and words.shape == self._eos_only.shape
        if self._broken or self._matcher.is_terminated():
            words[:] = self._eos_only
        elif self._scratch_valid:
            words[:] = self._scratch
        else:
            self._matcher.fill_next_token_bitmask(words)

    def accept(self, token: int) -> bool:
        if self._broken:
            return False
        self._scratch_valid = False
        if self._matcher.is_terminated() or not self._matcher.accept_token(token):
            self._broken = True
            return False
        return True

    @property
    def failed(self) -> bool:
        return self._broken

    @property
    def finished(self) -> bool:
        if self._broken or self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        if not self._scratch_valid:
            self._matcher.fill_next_token_bitmask(self._scratch)
            self._scratch_valid = True
        return not (self._scratch & ~self._eos_only).any()


class Backend:
    name = "xgrammar"
    kinds = KINDS

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        encoded, vocab_type = _vocabulary(tokenizer_json, vocab_size, eos_ids)
        info = xgrammar.TokenizerInfo(
            encoded,
            getattr(xgrammar.VocabType, vocab_type),
            vocab_size=vocab_size,
            stop_token_ids=list(eos_ids) or None,
            add_prefix_space=False,
        )
        self._compiler = xgrammar.GrammarCompiler(
            info, max_threads=min(8, os.cpu_count() or 1), cache_limit_bytes=CACHE_LIMIT_BYTES
        )
        eos_only = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
        for eos in info.stop_token_ids:
            if 0 <= eos < vocab_size:
                eos_only[eos // 32] |= np.uint32(1 << (eos % 32))
        self._eos_only = eos_only.view(np.int32)

    def compile(self, spec: GrammarSpec) -> Compiled:
        try:
            if spec.kind == "json_schema":
                check_json(spec.kind, spec.text)
                # Compact (", " and ": ", no other whitespace) and non-strict: the layout and
                # JSON Schema semantics of the llguidance backend (JSON_LAYOUT there), so the two
                # backends accept the same outputs and a weak model cannot pad with spaces.
                grammar = self._compiler.compile_json_schema(
                    spec.text, any_whitespace=False, separators=(", ", ": "), strict_mode=False
                )
            elif spec.kind == "regex":
                grammar = self._compiler.compile_regex(spec.text)
            elif spec.kind == "ebnf":
                grammar = self._compiler.compile_grammar(spec.text)
            elif spec.kind == "structural_tag":
                check_json(spec.kind, spec.text)
                grammar = self._compiler.compile_structural_tag(_structural_tag(spec.text))
            else:
                raise GrammarError(f"is {spec.kind}, which the xgrammar backend does not compile")
        except (RuntimeError, ValueError, TypeError) as exc:
            if isinstance(exc, GrammarError):
                raise
            raise GrammarError(_message(exc)) from None
        return Compiled(grammar)

    def matcher(self, compiled: Compiled) -> Matcher:  # type: ignore[override]
        return Matcher(self._xgr.GrammarMatcher(compiled.grammar), self._eos_only)


def create(tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> Backend:
    return Backend(tokenizer_json, vocab_size, eos_ids)


def _vocabulary(tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> tuple[list[str], str]:
    """The encoded vocabulary by id, `vocab_size` long, and xgrammar's name for its encoding.

    Special added tokens (chat markers, EOS) are blanked: xgrammar would otherwise treat their
    text, `<|im_start|>` say, as text a grammar may produce. A blank is xgrammar's special token,
    never allowed; EOS is allowed by id, as a stop token, all the same. Ids past the tokenizer
    (a logits width padded to a round number) are blanks too."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_str(tokenizer_json).get_vocab(with_added_tokens=True)
    document = json.loads(tokenizer_json)
    special = {item["id"] for item in document.get("added_tokens", []) if item.get("special")}
    special |= set(eos_ids)
    encoded = [""] * vocab_size
    for token, token_id in vocab.items():
        if token_id < vocab_size and token_id not in special:
            encoded[token_id] = token
    return encoded, _vocab_type(document, vocab)


def _vocab_type(document: dict[str, Any], vocab: dict[str, int]) -> str:
    """BYTE_LEVEL (GPT-2's bytes-as-characters, `Ġ` for a space), BYTE_FALLBACK (SentencePiece
    style, `▁` and `<0x0A>`) or RAW, from the decoder the tokenizer decodes with, else from the
    vocabulary itself."""
    decoder = document.get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {step.get("type") for step in steps if isinstance(step, dict)}
    if "ByteLevel" in kinds:
        return "BYTE_LEVEL"
    if "ByteFallback" in kinds or "<0x0A>" in vocab:
        return "BYTE_FALLBACK"
    return "RAW"


def _structural_tag(text: str) -> str:
    """SGLang's structural tag as xgrammar's own format: free text, where each trigger starts one
    of the tags whose begin it prefixes, held to that tag's schema until its end."""
    tags, triggers = structural_tags(text)
    value = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": triggers,
            "tags": [
                {
                    "type": "tag",
                    "begin": tag.begin,
                    "content": {"type": "json_schema", "json_schema": tag.schema},
                    "end": tag.end,
                }
                for tag in tags
            ],
        },
    }
    return json.dumps(value)


def _message(exc: Exception) -> str:
    lines = [_NOISE.sub("", line).strip() for line in str(exc).strip().splitlines()]
    lines = [line for line in lines if line]
    return lines[0] if lines else "invalid grammar"
