"""Tokenizer layer: loading a model directory, streaming detokenization, stop strings.

The tokenizers are built here, in temporary directories, so the tests need no downloads: a small
byte-level BPE trained on text with accents, CJK and emoji (small enough that multi-byte characters
split across tokens), and a word-level tokenizer with SentencePiece's Metaspace decoder, whose
decode of a token depends on whether a token precedes it.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from control_plane.frontend.detokenize import IncrementalDetokenizer, StopMatcher, TextStream
from control_plane.tokenizer import Tokenizer

EOS = "<eos>"
BOS = "<bos>"
WORDS = [
    "the", "model", "streams", "tokens", "café", "naïve", "résumé", "日本語", "東京", "こんにちは",
    "😀", "🚀", "emoji", "Ωmega", "straße", "数据", "über", "piñata", "🎉🎉", "€100",
]  # fmt: skip
# Characters for generated text: ASCII plus 2-, 3- and 4-byte UTF-8, including some never trained on.
ALPHABET = "abcdefgh XYZ.,!é ïñßΩ€日本語東京数据こんにちは😀🚀🎉🦀"


def _corpus(lines: int = 300) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(lines)]


def _train_byte_level_bpe() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def _write_model_dir(
    path: Path,
    tok: HFTokenizer,
    generation_config: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    tokenizer_config: dict[str, Any] | None = None,
) -> Path:
    """A model directory holding tokenizer.json and whichever config files are given."""
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    files = {
        "generation_config.json": generation_config,
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
    }
    for name, content in files.items():
        if content is not None:
            (path / name).write_text(json.dumps(content))
    return path


@pytest.fixture(scope="module")
def hf_bpe() -> HFTokenizer:
    return _train_byte_level_bpe()


@pytest.fixture(scope="module")
def bpe(hf_bpe: HFTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    eos = hf_bpe.token_to_id(EOS)
    model_dir = _write_model_dir(
        tmp_path_factory.mktemp("bpe"), hf_bpe, generation_config={"eos_token_id": eos}, config={}
    )
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def metaspace() -> HFTokenizer:
    words = ["hello", "world", "stream", "tokens", "with", "spaces"]
    vocab = {"<unk>": 0} | {f"▁{word}": i + 1 for i, word in enumerate(words)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


class _HFDecoder:
    """Adapts a bare `tokenizers.Tokenizer` to the detokenizer's `Decoder` protocol."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] = (1,)
) -> list[str]:
    """Push `ids` in chunks cycling through `chunk_sizes`; the pieces, the flush last."""
    pieces, start, turn = [], 0, 0
    while start < len(ids):
        size = chunk_sizes[turn % len(chunk_sizes)]
        pieces.append(detok.push(ids[start : start + size]))
        start, turn = start + size, turn + 1
    pieces.append(detok.flush())
    return pieces


# --- loading a model directory ---


def test_fixture_splits_multibyte_characters(bpe: Tokenizer) -> None:
    # Without split characters the streaming tests below would prove nothing.
    ids = bpe.encode("".join(ALPHABET))
    assert any("\ufffd" in bpe.decode([i]) for i in ids)


def test_from_dir_names_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("eos_field", [7, [7, 9]], ids=["int", "list"])
def test_eos_from_generation_config(hf_bpe: HFTokenizer, tmp_path: Path, eos_field: int | list[int]) -> None:
    model_dir = _write_model_dir(
        tmp_path, hf_bpe, generation_config={"eos_token_id": eos_field}, config={"eos_token_id": 3}
    )
    expected = {eos_field} if isinstance(eos_field, int) else set(eos_field)
    assert Tokenizer.from_dir(model_dir).eos_token_ids == expected


def test_eos_falls_back_to_config_then_tokenizer_config(hf_bpe: HFTokenizer, tmp_path: Path) -> None:
    from_config = _write_model_dir(
        tmp_path / "a", hf_bpe, generation_config={}, config={"eos_token_id": [4, 5]}
    )
    assert Tokenizer.from_dir(from_config).eos_token_ids == {4, 5}
    from_tok_config = _write_model_dir(
        tmp_path / "b", hf_bpe, tokenizer_config={"eos_token": {"content": EOS, "special": True}}
    )
    assert Tokenizer.from_dir(from_tok_config).eos_token_ids == {hf_bpe.token_to_id(EOS)}
    assert Tokenizer.from_dir(_write_model_dir(tmp_path / "c", hf_bpe)).eos_token_ids == frozenset()


def test_vocab_size_is_larger_of_config_and_tokenizer(hf_bpe: HFTokenizer, tmp_path: Path) -> None:
    size = hf_bpe.get_vocab_size(with_added_tokens=True)
    padded = _write_model_dir(tmp_path / "a", hf_bpe, config={"vocab_size": size + 64})
    assert Tokenizer.from_dir(padded).vocab_size == size + 64
    small = _write_model_dir(tmp_path / "b", hf_bpe, config={"vocab_size": 10})
    assert Tokenizer.from_dir(small).vocab_size == size


def test_add_bos_token_follows_tokenizer_config(hf_bpe: HFTokenizer, tmp_path: Path) -> None:
    bos = hf_bpe.token_to_id(BOS)
    plain = hf_bpe.encode("café").ids
    with_bos = _write_model_dir(
        tmp_path / "a", hf_bpe, tokenizer_config={"add_bos_token": True, "bos_token": BOS}
    )
    assert Tokenizer.from_dir(with_bos).encode("café") == [bos, *plain]
    assert Tokenizer.from_dir(with_bos).bos_token_id == bos
    # No add_bos_token: the post-processor decides, and this one adds nothing.
    assert Tokenizer.from_dir(_write_model_dir(tmp_path / "b", hf_bpe)).encode("café") == plain


def test_encode_decode_round_trip_skips_special_tokens(bpe: Tokenizer) -> None:
    ids = bpe.encode("naïve 日本語 🚀")
    eos = next(iter(bpe.eos_token_ids))
    assert bpe.decode([*ids, eos]) == "naïve 日本語 🚀"
    assert bpe.decode([*ids, eos], skip_special_tokens=False).endswith(EOS)


# --- incremental detokenization ---


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=60), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5)
)
def test_streaming_equals_full_decode(bpe: Tokenizer, text: str, chunks: list[int]) -> None:
    ids = bpe.encode(text)
    pieces = _stream(IncrementalDetokenizer(bpe, prompt_ids=[]), ids, chunks)
    assert "".join(pieces) == bpe.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


@settings(max_examples=100, deadline=None)
@given(prompt=st.text(alphabet=ALPHABET, max_size=30), text=st.text(alphabet=ALPHABET, max_size=30))
def test_streaming_after_prompt_emits_only_generated_text(bpe: Tokenizer, prompt: str, text: str) -> None:
    pieces = _stream(IncrementalDetokenizer(bpe, bpe.encode(prompt)), bpe.encode(text))
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_arbitrary_ids_stream_equals_full_decode(bpe: Tokenizer, data: st.DataObject) -> None:
    # Ids a model might sample in any order, invalid UTF-8 and special tokens included.
    ids = data.draw(st.lists(st.integers(0, bpe.vocab_size - 1), max_size=30))
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    pieces = _stream(IncrementalDetokenizer(bpe, prompt_ids=[]), ids, chunks)
    assert "".join(pieces) == bpe.decode(ids)


def test_special_tokens_after_a_split_character_do_not_lose_it(bpe: Tokenizer) -> None:
    # Found by CI's derandomized run: an incomplete byte followed by more skipped special tokens
    # than the decoding window holds used to vanish instead of coming out as U+FFFD.
    eos = min(bpe.special_token_ids)
    ids = [bpe.encode("🦀")[0], eos, eos, eos, eos, eos]
    assert "".join(_stream(IncrementalDetokenizer(bpe, prompt_ids=[]), ids)) == bpe.decode(ids)
    crab = bpe.encode("🦀")
    ids = [crab[0], eos, eos, eos, eos, *crab[1:]]
    assert "".join(_stream(IncrementalDetokenizer(bpe, prompt_ids=[]), ids)) == bpe.decode(ids) == "🦀"


def test_split_character_is_held_until_complete(bpe: Tokenizer) -> None:
    ids = bpe.encode("🦀")  # never trained on: its 4 bytes span several tokens
    assert len(ids) > 1
    detok = IncrementalDetokenizer(bpe, prompt_ids=[])
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🦀"]


def test_flush_releases_incomplete_character(bpe: Tokenizer) -> None:
    detok = IncrementalDetokenizer(bpe, prompt_ids=bpe.encode("x"))
    assert detok.push(bpe.encode("🦀")[:2]) == ""
    assert detok.flush() == "\ufffd"


def test_leading_space_depends_on_previous_token(metaspace: HFTokenizer) -> None:
    prompt, generated = metaspace.encode("hello").ids, metaspace.encode("world with spaces").ids
    decoder = _HFDecoder(metaspace)
    # Decoding tokens one at a time loses the spaces: this tokenizer needs its neighbours.
    assert "".join(decoder.decode([i]) for i in generated) == "worldwithspaces"
    pieces = _stream(IncrementalDetokenizer(decoder, prompt), generated)
    assert "".join(pieces) == " world with spaces"


class _RecordingDecoder(_HFDecoder):
    """Notes the longest id list it was asked to decode."""

    longest = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens)


def test_decode_window_does_not_grow_with_sequence(hf_bpe: HFTokenizer) -> None:
    # CJK and emoji make tokens that end mid-character, the case where a window could keep growing.
    decoder = _RecordingDecoder(hf_bpe)
    detok = IncrementalDetokenizer(decoder, prompt_ids=hf_bpe.encode("the model " * 50).ids)
    generated = hf_bpe.encode("streams 数据 café 日本語 😀🦀 " * 100).ids
    pieces = _stream(detok, generated, chunk_sizes=(1, 3))
    assert "".join(pieces) == hf_bpe.decode(generated)
    assert decoder.longest <= 4 + 3


# --- stop strings ---


def test_stop_held_prefix_released_when_it_diverges() -> None:
    matcher = StopMatcher(["abd"])
    assert matcher.feed("xab") == ("x", None)
    assert matcher.feed("c") == ("abc", None)
    assert matcher.feed("ab") == ("", None)
    assert matcher.feed("d and more") == ("", "abd")


def test_stop_found_inside_overlapping_candidates() -> None:
    matcher = StopMatcher(["aab"])
    assert matcher.feed("a") == ("", None)
    assert matcher.feed("a") == ("", None)
    assert matcher.feed("ab") == ("a", "aab")


def test_earliest_stop_wins() -> None:
    """The stop ending first wins. Here it also starts first, or at the same start as a longer stop,
    so the old rule (earliest start, applied per feed) gave the same answers."""
    assert StopMatcher(["world", "lo"]).feed("hello world") == ("hel", "lo")
    assert StopMatcher(["lo w", "lo"]).feed("hello world") == ("hel", "lo")


def test_holds_back_at_most_longest_stop_minus_one() -> None:
    matcher = StopMatcher(["xxxy", "yz"])
    assert matcher.feed("abxxxxx") == ("abxx", None)
    assert matcher.flush() == "xxx"


def test_flush_returns_held_text() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("done </") == ("done ", None)
    assert matcher.flush() == "</"
    assert matcher.flush() == ""


def test_feed_after_stop_raises() -> None:
    matcher = StopMatcher(["x"])
    assert matcher.feed("ax") == ("a", "x")
    with pytest.raises(RuntimeError):
        matcher.feed("more")


def test_empty_stop_rejected() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abcd", max_size=40),
    stops=st.lists(st.text(alphabet="abcd", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_stops_never_leak(text: str, stops: list[str], cuts: list[int]) -> None:
    matcher = StopMatcher(stops)
    out, stop = [], None
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in itertools.pairwise(bounds):
        piece, stop = matcher.feed(text[start:end])
        out.append(piece)
        if stop is not None:
            break
    streamed = "".join(out)
    assert not any(s in streamed for s in stops)
    assert text.startswith(streamed)
    if stop is None:
        assert streamed + matcher.flush() == text
    else:
        assert text[len(streamed) :].startswith(stop)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abc", max_size=40), stop=st.text(alphabet="abc", min_size=1, max_size=4))
def test_single_stop_cuts_at_first_occurrence_whatever_the_chunking(text: str, stop: str) -> None:
    matcher = StopMatcher([stop])
    out = []
    for char in text:  # worst case for held-back prefixes: one character at a time
        piece, matched = matcher.feed(char)
        out.append(piece)
        if matched:
            break
    index = text.find(stop)
    assert "".join(out) + ("" if index >= 0 else matcher.flush()) == (text[:index] if index >= 0 else text)


# --- text streams: both together ---


def _run_stream(stream: TextStream, ids: Sequence[int]) -> tuple[str, str | None]:
    out = []
    for token in ids:
        delta = stream.push([token])
        out.append(delta.text)
        if delta.stop is not None:
            return "".join(out), delta.stop
    return "".join(out) + stream.finish(), None


def test_stream_stops_on_string_spanning_tokens(bpe: Tokenizer) -> None:
    stop = "日本語!!"
    ids = bpe.encode("the café streams 日本語!! and then more")
    assert len(bpe.encode(stop)) > 1
    text, matched = _run_stream(TextStream(bpe, bpe.encode("prompt"), [stop, "never"]), ids)
    assert (text, matched) == ("the café streams ", stop)


def test_stream_stop_completed_by_split_character(bpe: Tokenizer) -> None:
    # The stop's last character is split over several byte tokens: the match waits for the
    # character, and nothing of the stop is streamed while waiting.
    ids = bpe.encode("go 🦀🦀 after")
    text, matched = _run_stream(TextStream(bpe, [], ["o 🦀"]), ids)
    assert (text, matched) == ("g", "o 🦀")


def test_stream_without_stop_returns_everything(bpe: Tokenizer) -> None:
    ids = bpe.encode("naïve résumé </")
    assert _run_stream(TextStream(bpe, [], ["</s>"]), ids) == ("naïve résumé </", None)


def test_finish_after_stop_is_empty(bpe: Tokenizer) -> None:
    stream = TextStream(bpe, [], ["model"])
    delta = stream.push(bpe.encode("the model streams"))
    assert delta.text == "the " and delta.stop == "model"
    assert stream.finish() == ""
