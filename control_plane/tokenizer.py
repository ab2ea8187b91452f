"""Tokenization for the control plane: prompts to ids, ids to text, and the ids the scheduler needs.

Built on the `tokenizers` library and a Hugging Face model directory's `tokenizer.json`; torch and
transformers stay out of the control plane because importing them costs seconds.

`Tokenizer`: encode/decode plus the ids the scheduler needs (EOS set, BOS, vocabulary size).
Streaming text to clients (incremental detokenizing, stop strings) is a frontend's job:
control_plane/frontend/detokenize.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import tokenizers
import tokenizers.decoders

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class Decoder(Protocol):
    """Anything that turns token ids into text (a `Tokenizer`, or a stand-in in tests)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character standing for each byte in a byte-level token.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, 0x7F-0xA0, the
    soft hyphen) for U+0100 onwards, in byte order. `tokenizers.pre_tokenizers.ByteLevel.alphabet()`
    is the same set of characters.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(0x100 + n) for n, b in enumerate(others)}


BYTE_LEVEL_CHARS = _byte_level_chars()
# str.translate tables: byte-level characters to the Latin-1 character of their byte (its
# latin-1 encoding is then the byte), and byte-level characters deleted (what is left of a token
# after it is not byte-level text).
_TO_LATIN1 = {ord(char): byte for byte, char in BYTE_LEVEL_CHARS.items()}
_DROP_BYTE_LEVEL: dict[int, None] = dict.fromkeys(_TO_LATIN1)


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

    __slots__ = (
        "_add_bos",
        "_bos_token_id",
        "_byte_tables",
        "_eos_token_ids",
        "_max_token_bytes",
        "_special_ids",
        "_tok",
        "_vocab_size",
    )

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
        # Token strings are at least as long in UTF-8 as the text they stand for (a byte-level
        # BPE maps each byte to one character, SentencePiece writes spaces as a 3-byte character).
        vocab = tok.get_vocab(with_added_tokens=True)
        self._max_token_bytes = max((len(t.encode("utf-8")) for t in vocab), default=1)
        self._byte_tables: dict[bool, Mapping[int, bytes] | None] = {}

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

    @property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers: a prompt of more than
        `max_token_bytes · n` bytes has more than n tokens, known without tokenizing it."""
        return self._max_token_bytes

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what grammar backends are built from)."""
        return str(self._tok.to_str())

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

    def token_bytes(self, skip_special_tokens: bool = True) -> Mapping[int, bytes] | None:
        """The bytes each id adds to `decode`'s output, for tokenizers whose decoder is byte-level.

        With a byte-level decoder (GPT-2's, Llama 3's, Qwen's, SmolLM2's; the embedded model's),
        `decode` maps each token's characters to bytes, joins the bytes and decodes them as UTF-8,
        replacing invalid sequences with U+FFFD. So for ids all in the table,
        `decode(ids, skip_special_tokens) == b"".join(table[i] for i in ids).decode("utf-8",
        "replace")`; special tokens map to b"" when they are skipped. Left out, because `decode`
        does not treat them so: added tokens otherwise, tokens that decode to nothing, ids beyond
        the vocabulary. None when the decoder is another kind (SentencePiece's, WordPiece's), or
        when a check of the table against `decode` fails.

        Built on first use (about 0.1 s for a 49k vocabulary) and kept; frontends build it at start.
        """
        if skip_special_tokens not in self._byte_tables:
            self._byte_tables[skip_special_tokens] = self._build_token_bytes(skip_special_tokens)
        return self._byte_tables[skip_special_tokens]

    def _build_token_bytes(self, skip_special_tokens: bool) -> Mapping[int, bytes] | None:
        tok = self._tok
        if not isinstance(tok.decoder, tokenizers.decoders.ByteLevel):
            return None
        added = tok.get_added_tokens_decoder()
        # `decode` looks ids up among added tokens first, and skips tokens by their content.
        added_content = {token.content for token in added.values()}
        table: dict[int, bytes] = {}
        for token, token_id in tok.get_vocab(with_added_tokens=False).items():
            if token_id in added or token in added_content or not token:
                continue
            if token.translate(_DROP_BYTE_LEVEL):
                # Not all byte-level characters: the decoder takes the token's own UTF-8 bytes.
                table[token_id] = token.encode("utf-8")
            else:
                table[token_id] = token.translate(_TO_LATIN1).encode("latin-1")
        if skip_special_tokens:
            table.update((token_id, b"") for token_id in self._special_ids)
        # One decode of the whole table, in id order, against the bytes: a tokenizers release
        # that decoded otherwise would fall back to decoding windows of ids, not stream wrong text.
        ids = sorted(table)
        expected = b"".join(table[i] for i in ids).decode("utf-8", "replace")
        if tok.decode(ids, skip_special_tokens=skip_special_tokens) != expected:
            return None
        return table
