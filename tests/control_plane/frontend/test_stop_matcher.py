"""StopMatcher at scale and against a brute-force reference.

The matcher must cost O(total stop length) to build and O(fed text) to run, whatever the number
or length of stop strings (a 1 MB stop string used to OOM the server; 10^5 stops slowed a
request from 0.4 s to 66 s), and the stop it reports must not depend on how the text was split
into feeds: the stop whose occurrence ends first wins, and among those ending at the same
character, the longest.
"""

from __future__ import annotations

import itertools
import random
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.frontend.detokenize import StopMatcher

T = TypeVar("T")


def _peak_bytes(build: Callable[[], T]) -> tuple[T, int]:
    """What `build` returns, and the peak of Python allocations while it ran."""
    tracemalloc.start()
    try:
        result = build()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


def _long_stop(length: int, alphabet: str = "abcdé日本") -> str:
    """A random stop string of `length` characters drawn from `alphabet`."""
    rng = random.Random(length)
    return "".join(rng.choice(alphabet) for _ in range(length))


# --- brute-force reference ---


def _reference_outcome(stops: Sequence[str], text: str) -> tuple[str, str | None]:
    """(text before the winning stop, the stop) for `text` fed in full; (text, None) without a match.

    The winner is the occurrence that ends first; among those ending at one character, the longest.
    """
    for end in range(1, len(text) + 1):
        ending_here = [stop for stop in stops if text.endswith(stop, 0, end)]
        if ending_here:
            stop = max(ending_here, key=len)
            return text[: end - len(stop)], stop
    return text, None


def _reference_held_len(stops: Sequence[str], text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop."""
    longest = max((len(stop) for stop in stops), default=1) - 1
    for length in range(min(longest, len(text)), 0, -1):
        if any(len(stop) > length and stop.startswith(text[-length:]) for stop in stops):
            return length
    return 0


def _split(text: str, cuts: Sequence[int]) -> list[str]:
    """`text` cut at the given offsets (clamped, any order, repeats give empty feeds)."""
    bounds = [0, *sorted(min(cut, len(text)) for cut in cuts), len(text)]
    return [text[start:end] for start, end in itertools.pairwise(bounds)]


def _run(stops: Sequence[str], feeds: Sequence[str]) -> tuple[str, str | None, str]:
    """(emitted text, matched stop, flushed text) for `feeds` fed one after another."""
    matcher = StopMatcher(stops)
    out = []
    for piece in feeds:
        emitted, stop = matcher.feed(piece)
        out.append(emitted)
        if stop is not None:
            return "".join(out), stop, matcher.flush()
    return "".join(out), None, matcher.flush()


_stop_lists = st.lists(st.text(alphabet="abc", min_size=1, max_size=5), max_size=4)
_cut_lists = st.lists(st.integers(0, 40), max_size=10)


@settings(max_examples=400, deadline=None)
@given(alphabet=st.sampled_from(["ab", "abc"]), data=st.data())
def test_matches_brute_force_reference_after_every_feed(alphabet: str, data: st.DataObject) -> None:
    stops = data.draw(st.lists(st.text(alphabet=alphabet, min_size=1, max_size=5), max_size=4))
    text = data.draw(st.text(alphabet=alphabet, max_size=40))
    feeds = _split(text, data.draw(_cut_lists))
    expected_before, expected_stop = _reference_outcome(stops, text)
    longest = max((len(stop) for stop in stops), default=1)
    matcher = StopMatcher(stops)
    emitted, seen = "", ""
    for piece in feeds:
        out, stop = matcher.feed(piece)
        emitted += out
        seen += piece
        assert not any(s in emitted for s in stops)
        if stop is not None:
            assert (emitted, stop) == (expected_before, expected_stop)
            assert matcher.stopped and matcher.flush() == ""
            return
        releasable = len(seen) - _reference_held_len(stops, seen)
        assert emitted == seen[:releasable]
        assert len(seen) - len(emitted) <= longest - 1
    assert expected_stop is None
    assert emitted + matcher.flush() == text
    assert not matcher.stopped


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=40), stops=_stop_lists, cuts=_cut_lists, cuts2=_cut_lists)
def test_outcome_does_not_depend_on_the_split(
    text: str, stops: list[str], cuts: list[int], cuts2: list[int]
) -> None:
    whole = _run(stops, [text])
    assert _run(stops, _split(text, cuts)) == whole
    assert _run(stops, _split(text, cuts2)) == whole
    assert _run(stops, list(text)) == whole


def test_stop_ending_first_wins_whatever_the_split() -> None:
    # The old matcher preferred the earliest start within one feed: "abcd" fed at once cut at 0.
    assert StopMatcher(["abcd", "bc"]).feed("abcd") == ("a", "bc")
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.feed("abc") == ("a", "bc")


def test_longest_stop_wins_among_those_ending_together() -> None:
    assert StopMatcher(["cd", "bcd", "abcd", "d"]).feed("xabcdy") == ("x", "abcd")
    matcher = StopMatcher(["d", "abcd"])
    assert [matcher.feed(char) for char in "xabc"] == [("x", None), ("", None), ("", None), ("", None)]
    assert matcher.feed("d") == ("", "abcd")


def test_duplicates_and_shared_prefixes() -> None:
    assert StopMatcher(["ab", "ab", "abc"]).feed("zzabc") == ("zz", "ab")
    assert StopMatcher(["abc", "abc"]).feed("ababc!") == ("ab", "abc")


def test_without_stops_text_passes_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("anything at all") == ("anything at all", None)
    assert matcher.flush() == ""


def test_flush_after_a_match_is_empty_and_feed_raises() -> None:
    matcher = StopMatcher(["stop"])
    assert matcher.feed("go st") == ("go ", None)
    assert matcher.feed("op now") == ("", "stop")
    assert matcher.flush() == ""
    with pytest.raises(RuntimeError):
        matcher.feed("more")


def test_empty_stop_rejected() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["x", ""])


# --- unicode ---


def test_multi_byte_characters() -> None:
    matcher = StopMatcher(["日本", "é!", "🦀🦀"])
    assert matcher.feed("café") == ("caf", None)
    assert matcher.feed(" 日") == ("é ", None)
    assert matcher.feed("本語") == ("", "日本")
    matcher = StopMatcher(["日本", "é!", "🦀🦀"])
    assert matcher.feed("🦀x🦀") == ("🦀x", None)
    assert matcher.flush() == "🦀"
    assert _run(["日本語"], ["東京日本", "語です"]) == ("東京", "日本語", "")


# --- scale ---


def test_long_stop_string_builds_in_little_memory() -> None:
    # The old matcher kept every proper prefix: a 450 MB peak for these 30,000 ASCII characters.
    stop = _long_stop(30_000, "abcd")
    matcher, peak = _peak_bytes(lambda: StopMatcher([stop]))
    assert peak < 5_000_000
    # Matching in little memory too, so the build cannot have been put off until the first feed.
    outputs, feed_peak = _peak_bytes(lambda: [matcher.feed("x" + stop[:-1]), matcher.feed(stop[-1] + "tail")])
    assert outputs == [("x", None), ("", stop)]
    assert feed_peak < 5_000_000


def test_million_character_stop_string() -> None:
    # A quadratic build would exhaust memory at this size: fail on a small one first.
    _, small_peak = _peak_bytes(lambda: StopMatcher([_long_stop(30_000, "abcd")]))
    assert small_peak < 5_000_000, "building would take memory quadratic in the stop's length"
    stop = _long_stop(1_000_000)
    matcher, peak = _peak_bytes(lambda: StopMatcher([stop]))
    assert peak < 50_000_000
    half = len(stop) // 2
    feeds = ["start " + stop[:half], stop[half:-1] + "#", stop + "!"]
    outputs, feed_peak = _peak_bytes(lambda: [matcher.feed(text) for text in feeds])
    # A near miss is released whole once it fails; the full stop then ends the stream.
    assert outputs == [("start ", None), (stop[:-1] + "#", None), ("", stop)]
    assert feed_peak < 50_000_000


def test_many_stop_strings_cost_work_proportional_to_the_text() -> None:
    rng = random.Random(7)
    # None of the stops can complete: they all end in "z", which the text never contains.
    stops = ["".join(rng.choices("abcdefgh", k=rng.randint(1, 11))) + "z" for _ in range(100_000)]
    text = "".join(rng.choices("abcdefgh", k=2_000))
    matcher = StopMatcher(stops)
    emitted = []
    fed_at = time.thread_time()  # CPU time: what feeding costs, not how long a busy machine made it wait
    for char in text:
        out, stop = matcher.feed(char)
        assert stop is None
        emitted.append(out)
    feeding = time.thread_time() - fed_at
    assert "".join(emitted) + matcher.flush() == text
    # About 10 ms; trying every stop at each character would take over a minute.
    assert feeding < 1.0, f"100,000 stop strings made feeding 2,000 characters take {feeding:.2f} s"
    automaton = matcher._automaton
    prefixes = {stop[:i] for stop in stops for i in range(1, len(stop) + 1)}
    assert automaton.state_count == len(prefixes) + 1
    # Each character moves at most one level deeper and each failure link at least one level
    # back up, so a stream of n characters follows at most n failure links.
    assert automaton.links_followed <= len(text)
