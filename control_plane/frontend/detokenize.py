"""Generated ids become client text in a frontend: incremental detokenizing, stop strings, and
the two wired together per sample.

- `IncrementalDetokenizer`: turns generated ids into text a few tokens at a time, never emitting
  half a UTF-8 character and keeping the spacing a full decode would produce.
- `StopMatcher`: holds back text that might begin a stop string so a stop never reaches a client.
- `TextStream` wires the two together for one request.
"""

from __future__ import annotations

import codecs
import sys
from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from control_plane.tokenizer import Decoder

# Byte-level decoders replace an incomplete trailing UTF-8 sequence with exactly one U+FFFD.
_REPLACEMENT = "\ufffd"

# Tokens kept in front of new ones when decoding. Each token carries at least one byte (skipped
# special tokens aside), so 4 tokens always reach back to the start of an incomplete character
# (at most 3 bytes); decoders that strip a leading space (SentencePiece's Metaspace) need just
# one real token in front.
_CONTEXT_TOKENS = 4

# (text, bytes consumed) for the UTF-8 in `data`, invalid sequences as U+FFFD; with final=False an
# incomplete sequence at the end is left unconsumed. The C codec itself, no incremental decoder
# object in Python around it.
_utf8_decode: Callable[[bytes, str, bool], tuple[str, int]] = codecs.utf_8_decode


def _decode_utf8(data: bytes) -> tuple[str, bytes]:
    """The text of `data` as tokenizers' byte-level decoder gives it (Rust's `from_utf8_lossy`:
    each maximal invalid subsequence one U+FFFD) up to an incomplete character at its end, and
    that character's bytes (b"" if none); the decoder gives one U+FFFD for those.

    CPython's codec agrees (tests/control_plane/frontend/test_detokenize.py checks it) but for one case:
    with final=False it keeps ED A0-BF (the start of a surrogate, which UTF-8 excludes) for more
    bytes, where Rust already gives a U+FFFD for each byte; decoded as final, so does CPython.
    """
    text, used = _utf8_decode(data, "replace", False)
    if used == len(data):
        return text, b""
    pending = data[used:]
    if pending[0] == 0xED and pending[1:] >= b"\xa0":
        return text + _utf8_decode(pending, "replace", True)[0], b""
    return text, pending


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

    The byte road. With a byte-level tokenizer (`Tokenizer.token_bytes`) and a context made only
    of tokens in its table, a push gives the same text without decoding any window:

    - the window's decode is the UTF-8 decoding (invalid bytes as U+FFFD) of its tokens' bytes;
    - that is the decoding of the context's bytes up to the incomplete character at their end (if
      any), followed by the decoding of that character's bytes (`_pending`) and the pushed bytes;
    - all of the context's text but a trailing U+FFFD (`_held`, "" when none) has been emitted.

    So a push emits `_held` and the decoding of `_pending` plus the pushed bytes, keeping back a
    trailing U+FFFD as above: a new incomplete character stays in `_pending` (its U+FFFD is never
    emitted), a U+FFFD decoded in full becomes `_held`. Both stay right for the next context (the
    window's last `_CONTEXT_TOKENS` tokens): it holds the incomplete character (at most 3 bytes,
    each token carrying one or more), and its own decoding ends as the window's does, since it
    reaches past any continuation bytes it starts with. Cost: a table lookup per token and a call
    of the C UTF-8 codec per push, 0.3-0.4 µs per token pushed singly where the two window
    decodes took 2.2-2.8 µs (bench/bench_detokenize.py). An id outside the table (a kept added
    token, an id beyond the vocabulary) is pushed the window's way, and so are the pushes after
    it until the context is all table tokens again; `flush` decodes the window's way.
    """

    __slots__ = (
        "_bytes",
        "_context",
        "_context_text",
        "_held",
        "_pending",
        "_skip_special_tokens",
        "_table",
        "_textless",
        "_tokenizer",
    )

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
        token_bytes: Callable[[bool], Mapping[int, bytes] | None] | None = getattr(
            tokenizer, "token_bytes", None
        )
        table = token_bytes(skip_special_tokens) if token_bytes is not None else None
        # Per id its bytes, b"" for a skipped special token; empty without a byte-level tokenizer.
        self._table: Mapping[int, bytes | None] = table or {}
        self._context: deque[int] = deque(self._last_with_text(prompt_ids), maxlen=_CONTEXT_TOKENS)
        self._bytes = False  # on the byte road: `_pending` and `_held` stand for `_context_text`
        self._pending = b""
        self._held = ""
        self._context_text = ""
        self._settle_context()

    def _last_with_text(self, token_ids: Sequence[int]) -> list[int]:
        """The last `_CONTEXT_TOKENS` ids of `token_ids` that carry text, in order."""
        textless = self._textless
        if not textless:
            return list(token_ids[-_CONTEXT_TOKENS:])
        last: list[int] = []
        for token in reversed(token_ids):
            if token not in textless:
                last.append(token)
                if len(last) == _CONTEXT_TOKENS:
                    break
        last.reverse()
        return last

    def _with_text(self, token_ids: Sequence[int]) -> list[int]:
        return [t for t in token_ids if t not in self._textless] if self._textless else list(token_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text that is now final (possibly empty)."""
        if self._bytes:
            # The byte road (see the class's docstring), inline: it runs once per token.
            if len(token_ids) == 1:
                data = self._table.get(token_ids[0])
                if data:
                    self._context.append(token_ids[0])
            else:
                data = self._take_bytes(token_ids)
            if data:
                if self._pending:
                    data = self._pending + data
                text, used = _utf8_decode(data, "replace", False)
                if used == len(data):
                    self._pending = b""
                else:
                    text, self._pending = _decode_utf8(data)
                text = self._held + text
                if self._pending:
                    self._held = ""
                    return text
                if text.endswith(_REPLACEMENT):
                    self._held = _REPLACEMENT
                    return text[:-1]
                self._held = ""
                return text
            if data is not None:
                return ""  # only skipped special tokens
            self._leave_bytes()
        token_ids = self._with_text(token_ids)
        if not token_ids:
            return ""
        new_text = _settled(self._decode([*self._context, *token_ids]))[len(self._context_text) :]
        self._context.extend(token_ids)
        self._settle_context()
        return new_text

    def _take_bytes(self, token_ids: Sequence[int]) -> bytes | None:
        """The bytes of `token_ids`, which then join the context (skipped special tokens aside);
        None, the context unchanged, when one of them is not in the table."""
        chunks = [self._table.get(t) for t in token_ids]
        if not all(chunks):
            if None in chunks:
                return None
            token_ids = [t for t, chunk in zip(token_ids, chunks, strict=True) if chunk]
        self._context.extend(token_ids)
        return b"".join(cast("list[bytes]", chunks))

    def _settle_context(self) -> None:
        """After the context changed the window's way: take the byte road if the context is all
        table tokens (its bytes decoded afresh), else decode the context's text."""
        if self._table:
            chunks = [self._table.get(t) for t in self._context]
            if all(chunks):
                text, self._pending = _decode_utf8(b"".join(cast("list[bytes]", chunks)))
                self._held = _REPLACEMENT if not self._pending and text.endswith(_REPLACEMENT) else ""
                self._bytes = True
                return
        self._context_text = _settled(self._decode(list(self._context)))

    def _leave_bytes(self) -> None:
        """Leave the byte road: the context's text, which it did not keep."""
        self._bytes = False
        self._context_text = _settled(self._decode(list(self._context)))

    def flush(self) -> str:
        """Return the held-back text, even an incomplete character (as U+FFFD)."""
        if self._bytes:
            self._leave_bytes()
        full = self._decode(list(self._context))
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


# Code point marking a state without children (no character has a negative code point).
_NO_CHILD = -1
# Code points come out of `str.encode` as 4-byte ints in machine order, no int object per character.
_UTF32 = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"


def _code_points(text: str) -> array[int]:
    """The code points of `text` (lone surrogates included) as an array of C ints."""
    codes = array("i")
    if codes.itemsize == 4:
        codes.frombytes(text.encode(_UTF32, "surrogatepass"))
    else:
        codes.extend(map(ord, text))
    return codes


class _StopAutomaton:
    """Aho–Corasick automaton over the characters of a set of stop strings.

    States are the nodes of the stops' trie, numbered from 0 (the root, the empty string); state s
    stands for the string spelled from the root to s. Per state, in parallel 4-byte arrays:

    - depth: the length of that string;
    - fail (failure link): the state of its longest proper suffix that is also in the trie;
    - match_len: the length of the longest stop that is a suffix of it, 0 if none (the output
      links folded in at build time, so spotting a match is one array read).

    Trie edges: a state's first child is in `_child_char` and `_child_gap` (child - state: a new
    stop's tail is a chain of consecutive states, so its gaps are all 1 and filled in bulk); the
    edges beyond the first, at most one per stop string, go into `_branches`. A dict per state
    would cost about 200 bytes a state, 200 MB for a 1 MB stop string; this costs 20 bytes.
    Building takes O(total stop length) time and memory.
    """

    __slots__ = ("_branches", "_child_char", "_child_gap", "_depth", "_fail", "_match_len", "links_followed")

    def __init__(self, stops: Sequence[str]) -> None:
        """Build the automaton for non-empty `stops` (duplicates allowed)."""
        self._child_char = array("i", [_NO_CHILD])
        self._child_gap = array("i", [0])
        self._depth = array("i", [0])
        self._match_len = array("i", [0])
        self._fail = array("i")
        self._branches: dict[int, dict[int, int]] = {}
        # Failure links followed by `step` since the build; tests check it grows like the text.
        self.links_followed = 0
        for stop in stops:
            self._insert(stop)
        self._link()
        self.links_followed = 0

    @property
    def state_count(self) -> int:
        """Number of states: distinct non-empty prefixes of the stops, plus the root."""
        return len(self._depth)

    def depth(self, state: int) -> int:
        """Length of the string `state` stands for."""
        return self._depth[state]

    def match_len(self, state: int) -> int:
        """Length of the longest stop that is a suffix of `state`'s string; 0 when none is."""
        return self._match_len[state]

    def step(self, state: int, code: int) -> int:
        """The state after reading the character with code point `code` in `state`.

        That is the state of the longest suffix of (state's string + the character) in the trie.
        Amortized O(1): each failure link followed makes the state shallower, and each character
        makes it at most one level deeper.
        """
        child_char, branches = self._child_char, self._branches
        while True:
            if child_char[state] == code:
                return state + self._child_gap[state]
            branch = branches.get(state)
            if branch is not None and code in branch:
                return branch[code]
            if state == 0:
                return 0
            state = self._fail[state]
            self.links_followed += 1

    def scan(self, state: int, text: str) -> tuple[int, int]:
        """Read `text` from `state` up to the first character that completes a stop.

        Returns (state reached, index of that character in `text`), or (state after all of
        `text`, -1) when no stop completes.
        """
        match_len, step = self._match_len, self.step
        for index, char in enumerate(text):
            state = step(state, ord(char))
            if match_len[state]:
                return state, index
        return state, -1

    def _child(self, state: int, code: int) -> int | None:
        """The trie child of `state` along `code`, or None (no failure links)."""
        if self._child_char[state] == code:
            return state + self._child_gap[state]
        branch = self._branches.get(state)
        return None if branch is None else branch.get(code)

    def _insert(self, stop: str) -> None:
        """Add `stop` to the trie, marking its state with its length as a first match length."""
        state, known = self._walk(stop)
        if known < len(stop):
            state = self._add_chain(state, stop[known:])
        self._match_len[state] = len(stop)

    def _walk(self, stop: str) -> tuple[int, int]:
        """The deepest state spelling a prefix of `stop`, and that prefix's length."""
        state = 0
        for index, char in enumerate(stop):
            child = self._child(state, ord(char))
            if child is None:
                return state, index
            state = child
        return state, len(stop)

    def _add_chain(self, parent: int, rest: str) -> int:
        """Hang a chain of new states spelling non-empty `rest` below `parent`; return its last state.

        The chain's states are numbered consecutively, so the arrays grow in bulk, in C.
        """
        first, length = len(self._depth), len(rest)
        self._attach(parent, ord(rest[0]), first)
        base = self._depth[parent]
        self._depth.extend(range(base + 1, base + length + 1))
        self._match_len.extend(array("i", [0]) * length)
        self._child_char.extend(_code_points(rest[1:]))
        self._child_char.append(_NO_CHILD)
        self._child_gap.extend(array("i", [1]) * length)
        self._child_gap[-1] = 0
        return first + length - 1

    def _attach(self, parent: int, code: int, child: int) -> None:
        """Add the trie edge parent --code--> child (the parent has no edge along `code` yet)."""
        if self._child_char[parent] == _NO_CHILD:
            self._child_char[parent] = code
            self._child_gap[parent] = child - parent
        else:
            self._branches.setdefault(parent, {})[code] = child

    def _link(self) -> None:
        """Set failure links and fold match lengths along them, in breadth-first order.

        A state's failure link and its target's match length are set when the state is queued;
        the target is shallower, hence queued and settled before. The root's children keep the
        root as their failure link.
        """
        fail = self._fail = array("i", [0]) * len(self._depth)
        match_len = self._match_len
        queue = deque(child for _, child in self._edges(0))
        while queue:
            state = queue.popleft()
            for code, child in self._edges(state):
                target = self.step(fail[state], code)
                fail[child] = target
                if not match_len[child]:
                    match_len[child] = match_len[target]
                queue.append(child)

    def _edges(self, state: int) -> list[tuple[int, int]]:
        """(code point, child) for each trie edge out of `state`."""
        code = self._child_char[state]
        if code == _NO_CHILD:
            return []
        first = (code, state + self._child_gap[state])
        branch = self._branches.get(state)
        return [first] if branch is None else [first, *branch.items()]


class _HeldText:
    """Text held back from the client: appended at the end, released from the front.

    Kept as pieces plus an offset into the first, so that appending and releasing cost the
    length of the text appended or released, not the length of the text held (which can reach a
    stop's length on every feed).
    """

    __slots__ = ("_length", "_offset", "_pieces")

    def __init__(self) -> None:
        self._pieces: deque[str] = deque()
        self._offset = 0  # characters of the first piece already released
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def push(self, text: str, release: int) -> str:
        """Append `text`, then remove and return the first `release` characters of all that is held.

        `release` is at most len(self) + len(text).
        """
        held = self._length
        if release < held:
            released = self._take(release)
            self._append(text)
            return released
        released = self.take_all() + text[: release - held]
        self._append(text[release - held :])
        return released

    def take_all(self) -> str:
        """Remove and return everything held."""
        return self._take(self._length)

    def _append(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._length += len(text)

    def _take(self, count: int) -> str:
        """Remove and return the first `count` characters (at most len(self))."""
        parts = []
        while count > 0:
            piece, start = self._pieces[0], self._offset
            end = min(len(piece), start + count)
            parts.append(piece[start:end])
            count -= end - start
            self._length -= end - start
            if end == len(piece):
                self._pieces.popleft()
                self._offset = 0
            else:
                self._offset = end
        return "".join(parts)


class StopMatcher:
    """Cuts a text stream at the first stop string, never letting any part of a stop through.

    Feed it the detokenizer's output, in pieces of any size. Contract:

    - A stop never reaches the client, not even partly. The text held back is exactly the longest
      suffix of the text seen so far that is a proper prefix of some stop (so at most
      max(len(stop)) - 1 characters); everything before it can no longer begin a stop and is
      released at once.
    - When the stream contains a stop, the stop whose occurrence ends first wins; among stops
      ending at the same character, the longest (it starts earliest). The winner does not depend
      on how the text was split into feeds. `feed` then returns the text before that occurrence
      and the stop; the rest is dropped, `stopped` is True, and a further `feed` raises
      RuntimeError.
    - `flush` returns the held text, for a generation that ended for another reason, and
      starts matching afresh (a stop cannot span a flush).

    Cost: building is O(total stop length) in time and memory (an Aho–Corasick automaton); a
    feed costs O(len(text fed) + len(text released)), amortized over the stream, whatever the
    number or length of the stops. Without stops, `feed` returns its input untouched.
    """

    __slots__ = ("_automaton", "_held", "_state", "_stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        """Raises ValueError on an empty stop string (it would match before any text)."""
        if any(stop == "" for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self._automaton = _StopAutomaton(stops) if stops else None
        self._state = 0  # the automaton's state; its depth is the held text's length
        self._held = _HeldText()
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has been matched."""
        return self._stopped

    def feed(self, new_text: str) -> tuple[str, str | None]:
        """Return (text safe to stream now, matched stop or None).

        On a match, the text before the winning stop's occurrence is returned and the rest dropped.
        Raises RuntimeError when called after a match.
        """
        if self._stopped:
            raise RuntimeError("StopMatcher.feed called after a stop string matched")
        automaton = self._automaton
        if automaton is None:
            return new_text, None
        state, index = automaton.scan(self._state, new_text)
        if index >= 0:
            return self._cut(new_text[: index + 1], automaton.match_len(state))
        self._state = state
        release = len(self._held) + len(new_text) - automaton.depth(state)
        return self._held.push(new_text, release), None

    def flush(self) -> str:
        """Return the held-back text, for a generation that ended for another reason."""
        self._state = 0
        return self._held.take_all()

    def _cut(self, head: str, stop_len: int) -> tuple[str, str]:
        """Finish on a stop of `stop_len` characters ending `head`, the fed text up to its end.

        The stop lies within the held text plus `head`: until its last character came, it could
        still begin a stop, so none of it was released.
        """
        text = self._held.take_all() + head
        cut = len(text) - stop_len
        self._stopped = True
        self._state = 0
        return text[:cut], text[cut:]


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one push adds to a request's output."""

    text: str  # safe to send to the client now; never contains any part of a stop string
    stop: str | None  # the stop string that ended the generation, or None to continue


class TextStream:
    """Detokenization and stop-string matching for one request's generated tokens."""

    __slots__ = ("_detokenizer", "_matcher", "_unmatched_tokens")

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int],
        stops: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_new_tokens: int = 0,
    ) -> None:
        """Stop strings are looked for only in text of tokens after the first `min_new_tokens`."""
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._matcher = StopMatcher(stops)
        self._unmatched_tokens = min_new_tokens

    def push(self, token_ids: Sequence[int]) -> StreamDelta:
        """Add generated ids. A delta with `stop` set is the last; pushing after it raises RuntimeError."""
        text = self._detokenizer.push(token_ids)
        if self._unmatched_tokens > 0:
            self._unmatched_tokens -= len(token_ids)
            return StreamDelta(text, None)
        text, stop = self._matcher.feed(text)
        return StreamDelta(text, stop)

    def finish(self) -> str:
        """Return the text still held back when the generation ends without a stop string.

        A stop completed by the held-back text still cuts it; after a stop, returns "".
        """
        if self._matcher.stopped:
            return ""
        text, stop = self._matcher.feed(self._detokenizer.flush())
        return text if stop is not None else text + self._matcher.flush()
