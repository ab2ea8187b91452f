"""Tokenization for the control plane: encode prompts, stream decoded text, cut at stop strings.

Built on the `tokenizers` library and a Hugging Face model directory's `tokenizer.json`; torch and
transformers stay out of the control plane because importing them costs seconds.

Three layers, each usable alone:

- `Tokenizer`: encode/decode plus the ids the scheduler needs (EOS set, BOS, vocabulary size).
- `IncrementalDetokenizer`: turns generated ids into text a few tokens at a time, never emitting
  half a UTF-8 character and keeping the spacing a full decode would produce.
- `StopMatcher`: holds back text that might begin a stop string so a stop never reaches a client.

`TextStream` wires the last two together for one request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# Byte-level decoders replace an incomplete trailing UTF-8 sequence with exactly one U+FFFD.
_REPLACEMENT = "\ufffd"

# Tokens kept in front of new ones when decoding. Each token carries at least one byte (skipped
# special tokens aside), so 4 tokens always reach back to the start of an incomplete character
# (at most 3 bytes); decoders that strip a leading space (SentencePiece's Metaspace) need just
# one real token in front.
_CONTEXT_TOKENS = 4


class Decoder(Protocol):
    """Anything that turns token ids into text (a `Tokenizer`, or a stand-in in tests)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or an empty dict when the file does not exist."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_id_set(value: Any) -> frozenset[int]:
    """An `eos_token_id` field (int, list of ints or null) as a set of ids."""
    if isinstance(value, int) and not isinstance(value, bool):
        return frozenset({value})
    if isinstance(value, list):
        return frozenset(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return frozenset()


def _token_content(value: Any) -> str | None:
    """A tokenizer_config special-token entry: a plain string or an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_token_id(
    field: str, configs: Sequence[dict[str, Any]], tok_config: dict[str, Any], tok: tokenizers.Tokenizer
) -> frozenset[int]:
    """Ids for `field` (e.g. "eos") from the first config that names them, else from the token string.

    `configs` are searched in priority order for `<field>_token_id`; tokenizer_config's
    `<field>_token` string is the last resort, looked up in the vocabulary.
    """
    for config in configs:
        ids = _as_id_set(config.get(f"{field}_token_id"))
        if ids:
            return ids
    content = _token_content(tok_config.get(f"{field}_token"))
    token_id = tok.token_to_id(content) if content is not None else None
    return frozenset() if token_id is None else frozenset({token_id})


class Tokenizer:
    """A model's tokenizer plus the special ids the scheduler needs. Immutable after construction."""

    __slots__ = ("_add_bos", "_bos_token_id", "_eos_token_ids", "_special_ids", "_tok", "_vocab_size")

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        eos_token_ids: frozenset[int],
        bos_token_id: int | None = None,
        add_bos: bool | None = None,
        vocab_size: int = 0,
    ) -> None:
        """Wrap `tok`. `add_bos=None` leaves BOS to the tokenizer's own post-processor.

        `vocab_size` below the tokenizer's own size (with added tokens) is raised to it.
        """
        self._tok = tok
        self._eos_token_ids = eos_token_ids
        self._bos_token_id = bos_token_id
        self._add_bos = add_bos
        self._vocab_size = max(vocab_size, tok.get_vocab_size(with_added_tokens=True))
        self._special_ids = frozenset(
            i for i, added in tok.get_added_tokens_decoder().items() if added.special
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        """Load a Hugging Face model directory's tokenizer.

        EOS ids come from generation_config.json, then config.json (`eos_token_id`, int or list),
        then tokenizer_config.json's `eos_token`; none found gives an empty set. BOS likewise.
        Raises FileNotFoundError naming tokenizer.json when it is missing.
        """
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {model_dir} (looked for {tokenizer_path})")
        tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        gen_config = _read_json(model_dir / GENERATION_CONFIG_FILE)
        model_config = _read_json(model_dir / MODEL_CONFIG_FILE)
        tok_config = _read_json(model_dir / TOKENIZER_CONFIG_FILE)
        configs = (gen_config, model_config)
        bos_ids = _special_token_id("bos", configs, tok_config, tok)
        add_bos = tok_config.get("add_bos_token")
        vocab_size = model_config.get("vocab_size")
        return cls(
            tok,
            eos_token_ids=_special_token_id("eos", configs, tok_config, tok),
            bos_token_id=min(bos_ids) if bos_ids else None,
            add_bos=add_bos if isinstance(add_bos, bool) else None,
            vocab_size=vocab_size if isinstance(vocab_size, int) else 0,
        )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a generation (may be empty when the model directory names none)."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, or None when the model has none."""
        return self._bos_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of special tokens: they carry no text when decoding skips special tokens."""
        return self._special_ids

    @property
    def vocab_size(self) -> int:
        """Number of logits rows: the larger of config.json's vocab_size and the tokenizer's size."""
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids for a prompt, with the special tokens the model expects.

        The tokenizer's post-processor decides first; an explicit `add_bos_token` in
        tokenizer_config.json then adds or removes a leading BOS to match it.
        """
        ids: list[int] = self._tok.encode(text, add_special_tokens=True).ids
        bos = self._bos_token_id
        if bos is None or self._add_bos is None:
            return ids
        has_bos = bool(ids) and ids[0] == bos
        if self._add_bos and not has_bos:
            return [bos, *ids]
        if not self._add_bos and has_bos:
            return ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`; incomplete UTF-8 sequences become U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Streams the text of generated tokens, a push at a time, for one request.

    Technique (prefix offset / read offset): decode a window made of the last `_CONTEXT_TOKENS`
    tokens already handled (the context) plus the pushed ones, and emit what the window's text
    adds beyond the context's text. Decoding with context keeps neighbour-dependent spacing right.
    Text ending in U+FFFD is held back by one character, since that U+FFFD may be a multi-byte
    character whose remaining bytes have not arrived; everything before it is settled.

    Invariant: all text up to the end of `_context_text` (the context's decode, less a trailing
    U+FFFD) has been emitted. Cost per push is O(`_CONTEXT_TOKENS` + pushed tokens), whatever
    the sequence length. For byte-level BPE the concatenated output equals the decode of all
    generated ids once `flush` is called; a character split around more than three skipped
    special tokens (only garbage output does that) can come out as U+FFFD.
    """

    __slots__ = ("_context", "_context_text", "_skip_special_tokens", "_textless", "_tokenizer")

    def __init__(
        self, tokenizer: Decoder, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        """Start after `prompt_ids`; only their last few tokens are kept, as decoding context."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Skipped special tokens carry no text. Kept out of the context they cannot push the
        # bytes of an incomplete character out of it (a character spans at most 4 byte tokens).
        special: frozenset[int] = getattr(tokenizer, "special_token_ids", frozenset())
        self._textless = special if skip_special_tokens else frozenset()
        self._context: list[int] = self._with_text(prompt_ids)[-_CONTEXT_TOKENS:]
        self._context_text = _settled(self._decode(self._context))

    def _with_text(self, token_ids: Sequence[int]) -> list[int]:
        return [t for t in token_ids if t not in self._textless] if self._textless else list(token_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text that is now final (possibly empty)."""
        token_ids = self._with_text(token_ids)
        if not token_ids:
            return ""
        window = [*self._context, *token_ids]
        new_text = _settled(self._decode(window))[len(self._context_text) :]
        self._context = window[-_CONTEXT_TOKENS:]
        self._context_text = _settled(self._decode(self._context))
        return new_text

    def flush(self) -> str:
        """Return the held-back text, even an incomplete character (as U+FFFD)."""
        full = self._decode(self._context)
        held = full[len(self._context_text) :]
        self._context_text = full
        return held

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _settled(text: str) -> str:
    """`text` less a trailing U+FFFD, which more bytes could still turn into a character.

    Byte-level decoders replace an incomplete trailing UTF-8 sequence with exactly one U+FFFD
    and never change what comes before it when more bytes arrive.
    """
    return text[:-1] if text.endswith(_REPLACEMENT) else text


class StopMatcher:
    """Cuts a text stream at the first stop string, never letting any part of a stop through.

    Feed it the detokenizer's output. A suffix that could begin a stop string is held back (at
    most max(len(stop)) - 1 characters) until later text rules the stop in or out. When several
    stops are present, the one that starts earliest wins; at the same start, the shorter one,
    since it completed first. After a match the matcher is finished and `feed` must not be called.
    """

    __slots__ = ("_held", "_prefixes", "_stopped", "_stops")

    def __init__(self, stops: Sequence[str]) -> None:
        """Raises ValueError on an empty stop string (it would match before any text)."""
        if any(stop == "" for stop in stops):
            raise ValueError("stop strings must be non-empty")
        # Shortest first, so that among matches at one index the shorter is found first.
        self._stops = sorted(set(stops), key=len)
        # Every proper prefix of every stop: the suffixes worth holding back.
        self._prefixes = frozenset(stop[:i] for stop in self._stops for i in range(1, len(stop)))
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has been matched."""
        return self._stopped

    def feed(self, new_text: str) -> tuple[str, str | None]:
        """Return (text safe to stream now, matched stop or None).

        On a match, the text before the stop's first occurrence is returned and the rest dropped.
        Raises RuntimeError when called after a match.
        """
        if self._stopped:
            raise RuntimeError("StopMatcher.feed called after a stop string matched")
        text = self._held + new_text
        cut, stop = self._earliest_stop(text)
        if stop is not None:
            self._held = ""
            self._stopped = True
            return text[:cut], stop
        keep = self._held_suffix_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """Return the held-back text, for a generation that ended for another reason."""
        held, self._held = self._held, ""
        return held

    def _earliest_stop(self, text: str) -> tuple[int, str | None]:
        """Index and value of the stop occurring earliest in `text`; (-1, None) when none does."""
        best_index, best_stop = len(text), None
        for stop in self._stops:
            # Search only up to where an earlier match could still start.
            index = text.find(stop, 0, best_index + len(stop) - 1)
            if index != -1 and index < best_index:
                best_index, best_stop = index, stop
        return (best_index, best_stop) if best_stop is not None else (-1, None)

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop."""
        longest = max((len(stop) for stop in self._stops), default=1) - 1
        for length in range(min(longest, len(text)), 0, -1):
            if text[-length:] in self._prefixes:
                return length
        return 0


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one push adds to a request's output."""

    text: str  # safe to send to the client now; never contains any part of a stop string
    stop: str | None  # the stop string that ended the generation, or None to continue


class TextStream:
    """Detokenization and stop-string matching for one request's generated tokens."""

    __slots__ = ("_detokenizer", "_matcher")

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int],
        stops: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._matcher = StopMatcher(stops)

    def push(self, token_ids: Sequence[int]) -> StreamDelta:
        """Add generated ids. A delta with `stop` set is the last; pushing after it raises RuntimeError."""
        text, stop = self._matcher.feed(self._detokenizer.push(token_ids))
        return StreamDelta(text, stop)

    def finish(self) -> str:
        """Return the text still held back when the generation ends without a stop string.

        A stop completed by the held-back text still cuts it; after a stop, returns "".
        """
        if self._matcher.stopped:
            return ""
        text, stop = self._matcher.feed(self._detokenizer.flush())
        return text if stop is not None else text + self._matcher.flush()
