"""The detokenizer's byte road gives the text the window decodes gave, push for push.

`IncrementalDetokenizer` decodes byte-level tokenizers' ids from a table of their bytes with the C
UTF-8 codec instead of two window decodes per push (`Tokenizer.token_bytes`). The window algorithm
it replaced is kept below, verbatim, as the reference: every push's text and every flush must be
the same, for random streams over the embedded model's tokenizer, a byte-level BPE small enough
to split multi-byte characters (with added tokens that take the window's way), SmolLM2's when its
local cache has it, and a Metaspace tokenizer (no table: the window's way throughout).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders
from tokenizers import Tokenizer as HFTokenizer

from control_plane.frontend.detokenize import IncrementalDetokenizer, _decode_utf8
from control_plane.tokenizer import BYTE_LEVEL_CHARS, Decoder, Tokenizer
from stepwise import embedded, smollm2
from tests.control_plane.test_tokenizer import ALPHABET, EOS, _train_byte_level_bpe

_CONTEXT_TOKENS = 4
_REPLACEMENT = "\ufffd"


class _WindowDetokenizer:
    """The detokenizer before the byte road (two decodes per push), as the reference."""

    __slots__ = ("_context", "_context_text", "_skip_special_tokens", "_textless", "_tokenizer")

    def __init__(
        self, tokenizer: Decoder, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        special: frozenset[int] = getattr(tokenizer, "special_token_ids", frozenset())
        self._textless = special if skip_special_tokens else frozenset()
        self._context: list[int] = self._with_text(prompt_ids)[-_CONTEXT_TOKENS:]
        self._context_text = _settled(self._decode(self._context))

    def _with_text(self, token_ids: Sequence[int]) -> list[int]:
        return [t for t in token_ids if t not in self._textless] if self._textless else list(token_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        token_ids = self._with_text(token_ids)
        if not token_ids:
            return ""
        window = [*self._context, *token_ids]
        new_text = _settled(self._decode(window))[len(self._context_text) :]
        self._context = window[-_CONTEXT_TOKENS:]
        self._context_text = _settled(self._decode(self._context))
        return new_text

    def flush(self) -> str:
        full = self._decode(self._context)
        held = full[len(self._context_text) :]
        self._context_text = full
        return held

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _settled(text: str) -> str:
    return text[:-1] if text.endswith(_REPLACEMENT) else text


# --- the tokenizers ---


def _embedded() -> Tokenizer:
    return Tokenizer.from_dir(embedded.resolve())


def _bpe_with_added_tokens() -> Tokenizer:
    """The small byte-level BPE plus added tokens `decode` treats its own way: a plain one (kept
    whatever skip_special_tokens says) and a special one made of byte-level characters."""
    tok = _train_byte_level_bpe()
    tok.add_tokens([AddedToken("<tool>", special=False), AddedToken("Ġsp ace", special=False)])
    tok.add_special_tokens([AddedToken("Ġsep", special=True)])
    return Tokenizer(tok, eos_token_ids=frozenset({tok.token_to_id(EOS)}))


def _smollm2() -> Tokenizer:
    return Tokenizer.from_dir(smollm2.checkpoint_dir())


def _metaspace() -> Tokenizer:
    from tokenizers import models, pre_tokenizers

    words = ["hello", "world", "stream", "tokens", "with", "spaces", "日本"]
    vocab = {"<unk>": 0} | {f"▁{word}": i + 1 for i, word in enumerate(words)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["</s>"])
    return Tokenizer(tok, eos_token_ids=frozenset())


TOKENIZERS = {"embedded": _embedded, "bpe": _bpe_with_added_tokens, "metaspace": _metaspace}
if (smollm2.checkpoint_dir() / "tokenizer.json").is_file():
    TOKENIZERS["smollm2"] = _smollm2


@cache
def _tokenizer(name: str) -> Tokenizer:
    return TOKENIZERS[name]()


def _ids(tok: Tokenizer, max_segments: int) -> st.SearchStrategy[list[int]]:
    """Id streams a model might sample: text of characters of 1 to 4 UTF-8 bytes (so characters
    split across tokens), any ids at all (ids beyond the vocabulary too), byte tokens (invalid
    UTF-8 of every kind), and runs of special tokens (skipped or not)."""
    size = tok.vocab_size
    specials = sorted(tok.special_token_ids)
    table = tok.token_bytes() or {}
    # Tokens of one byte, to make every kind of invalid UTF-8 as likely as valid characters.
    bytes_ = sorted(i for i, data in table.items() if len(data) == 1) or [0]
    segment = st.one_of(
        st.text(alphabet=ALPHABET, max_size=12).map(tok.encode),
        st.lists(st.integers(0, size + 2), max_size=6),
        st.lists(st.sampled_from(bytes_), max_size=8),
        st.lists(st.sampled_from(specials), min_size=1, max_size=5),
        # The start of a character whose remaining bytes never come.
        st.sampled_from("é日😀🦀€").map(lambda char: tok.encode(char)[:-1]),
    )
    return st.lists(segment, max_size=max_segments).map(lambda parts: list(itertools.chain(*parts)))


def _run(
    detok: IncrementalDetokenizer | _WindowDetokenizer, ids: Sequence[int], sizes: Sequence[int]
) -> list[str]:
    """Every push's text, then the flush's; then one more push and flush (pushing after a flush)."""
    out, start = [], 0
    for size in itertools.cycle(sizes):
        if start >= len(ids):
            break
        out.append(detok.push(ids[start : start + size]))
        start += size
    out.append(detok.flush())
    out.append(detok.push(ids[:3]))
    out.append(detok.flush())
    return out


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_byte_road_streams_what_window_decodes_stream(name: str, data: st.DataObject) -> None:
    tok = _tokenizer(name)
    prompt = data.draw(_ids(tok, 3), label="prompt")
    ids = data.draw(_ids(tok, 8), label="ids")
    # Pushes of one token (a sample with stop strings) and of several (a message's worth).
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4), label="sizes")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    expected = _run(_WindowDetokenizer(tok, prompt, skip), ids, sizes)
    assert _run(IncrementalDetokenizer(tok, prompt, skip), ids, sizes) == expected


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("skip", [True, False])
def test_long_text_streams_the_same_token_by_token(name: str, skip: bool) -> None:
    tok = _tokenizer(name)
    text = "streams 数据 café 日本語 😀🦀 naïve ".join(ALPHABET) * 3
    ids = tok.encode(text)
    specials = sorted(tok.special_token_ids)
    ids = [*ids[:50], *specials, *ids[50:]]
    for sizes in [(1,), (3, 1, 7)]:
        expected = _run(_WindowDetokenizer(tok, ids[:9], skip), ids, sizes)
        assert _run(IncrementalDetokenizer(tok, ids[:9], skip), ids, sizes) == expected


def test_every_short_byte_sequence_streams_the_same() -> None:
    """Byte tokens for every string of byte kinds up to 3 long, after an ASCII token and after a
    lead byte, pushed one at a time and all at once: every kind of invalid UTF-8 at every offset."""
    tok = _tokenizer("embedded")
    table = tok.token_bytes()
    assert table is not None
    byte_token = {data[0]: i for i, data in table.items() if len(data) == 1}
    assert len(byte_token) == 256
    for length in range(1, 4):
        for kinds in itertools.product(_BYTE_KINDS, repeat=length):
            ids = [byte_token[b] for b in kinds]
            for prompt in ([byte_token[0x41]], [byte_token[0xF0]]):
                for sizes in [(1,), (length,)]:
                    expected = _run(_WindowDetokenizer(tok, prompt), ids, sizes)
                    assert _run(IncrementalDetokenizer(tok, prompt), ids, sizes) == expected, kinds


class _CountingDecoder:
    """A `Tokenizer` in all but `decode`, which it counts."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.special_token_ids = tok.special_token_ids
        self.token_bytes = tok.token_bytes
        self.decodes = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decodes += 1
        return self._tok.decode(ids, skip_special_tokens)


def test_byte_road_decodes_nothing_until_a_token_outside_the_table() -> None:
    tok = _tokenizer("bpe")
    counting = _CountingDecoder(tok)
    ids = tok.encode("naïve 日本語 🦀 " * 20)
    detok = IncrementalDetokenizer(counting, ids[:7])
    text = "".join(detok.push([i]) for i in ids) + detok.push([*sorted(tok.special_token_ids), ids[0]])
    assert counting.decodes == 0
    assert text == tok.decode(ids + ids[:1])
    tool = tok.encode("<tool>")
    table = tok.token_bytes()
    assert len(tool) == 1 and table is not None and tool[0] not in table
    assert detok.push(tool) == "<tool>"
    # The window's way while the added token is in the context, the table's again once it is out.
    letters = tok.encode("a b c d")
    assert len(letters) >= _CONTEXT_TOKENS
    assert "".join(detok.push([i]) for i in letters) == "a b c d"
    decodes = counting.decodes
    assert detok.push(ids[:20]) + detok.flush() == tok.decode(ids[:20])
    assert counting.decodes == decodes + 2  # the flush's: the context's text and its full decode


# --- the table and the codec it relies on ---


@pytest.mark.parametrize("name", ["embedded", "bpe", *(["smollm2"] if "smollm2" in TOKENIZERS else [])])
@pytest.mark.parametrize("skip", [True, False])
def test_token_bytes_decode_like_the_tokenizer(name: str, skip: bool) -> None:
    tok = _tokenizer(name)
    table = tok.token_bytes(skip)
    assert table is not None
    for token_id, data in table.items():
        assert tok.decode([token_id], skip) == data.decode("utf-8", "replace"), token_id
    added = set(tok._tok.get_added_tokens_decoder())
    assert set(table) | added == set(range(tok._tok.get_vocab_size(with_added_tokens=True)))
    assert {i for i in added if i in table} == (set(tok.special_token_ids) if skip else set())


def test_no_table_for_other_decoders() -> None:
    assert _tokenizer("metaspace").token_bytes() is None


# Bytes of every kind UTF-8 distinguishes: ASCII, continuation bytes (in each range a lead byte's
# second byte may be restricted to), lead bytes of 2, 3 and 4 bytes (E0, ED, F0 and F4 restrict
# their second byte), and bytes never valid (C0, C1, F5-FF).
_BYTE_KINDS = bytes(
    [0x41, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEE, 0xF0, 0xF1,
     0xF4, 0xF5, 0xFF]
)  # fmt: skip
_BYTE_LEVEL = decoders.ByteLevel()


def _rust_lossy(data: bytes) -> str:
    """What tokenizers' byte-level decoder makes of `data` (Rust's String::from_utf8_lossy)."""
    return str(_BYTE_LEVEL.decode(["".join(BYTE_LEVEL_CHARS[b] for b in data)]))


def _check_codec(data: bytes) -> None:
    """The C codec decodes `data` as the tokenizer does, at once and in two parts (the first
    part's incomplete character carried over), the first part's text being the tokenizer's less
    the one U+FFFD it gives an incomplete character."""
    whole = _rust_lossy(data)
    assert data.decode("utf-8", "replace") == whole, data
    for cut in range(len(data) + 1):
        text, pending = _decode_utf8(data[:cut])
        assert len(pending) <= 3
        assert _rust_lossy(data[:cut]) == text + (_REPLACEMENT if pending else ""), (data, cut)
        rest, tail = _decode_utf8(pending + data[cut:])
        assert text + rest + (_REPLACEMENT if tail else "") == whole, (data, cut)


def test_c_utf8_codec_decodes_like_the_byte_level_decoder() -> None:
    for length in range(1, 4):  # every string of byte kinds up to 3 bytes
        for data in itertools.product(_BYTE_KINDS, repeat=length):
            _check_codec(bytes(data))


@settings(max_examples=300, deadline=None)
@given(data=st.lists(st.sampled_from(_BYTE_KINDS), max_size=12).map(bytes))
def test_c_utf8_codec_decodes_like_the_byte_level_decoder_longer(data: bytes) -> None:
    _check_codec(data)
