"""SlotAllocator: paged allocation contract (docs/scheduler.md#allocation) and determinism."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.cache.allocator import SlotAllocator


def slots(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def test_page1_alloc_hands_out_ids_in_order_and_none_when_short() -> None:
    alloc = SlotAllocator(8)
    assert alloc.alloc(3).tolist() == [0, 1, 2]  # type: ignore[union-attr]
    assert alloc.available_size() == 5
    assert alloc.alloc(6) is None
    assert alloc.available_size() == 5  # a refused allocation takes nothing


def test_paged_alloc_requires_whole_pages() -> None:
    alloc = SlotAllocator(16, page_size=4)
    assert alloc.alloc(8).tolist() == list(range(8))  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        alloc.alloc(3)


def test_capacity_must_be_whole_pages() -> None:
    with pytest.raises(ValueError):
        SlotAllocator(10, page_size=4)


def test_freed_pages_go_to_the_back_of_the_free_list() -> None:
    alloc = SlotAllocator(16, page_size=4)
    first = alloc.alloc(8)
    assert first is not None
    alloc.free(first[:4])
    assert alloc.free_pages().tolist() == [2, 3, 0]
    assert alloc.alloc(12).tolist() == [*range(8, 16), 0, 1, 2, 3]  # type: ignore[union-attr]


def test_free_releases_the_unique_pages_of_the_given_slots() -> None:
    alloc = SlotAllocator(16, page_size=4)
    assert alloc.alloc(16) is not None
    alloc.free(slots(9, 1, 2, 10))  # pages 2 and 0, freed in id order as SGLang does
    assert alloc.free_pages().tolist() == [0, 2]
    assert alloc.available_size() == 8


def test_double_free_is_refused() -> None:
    alloc = SlotAllocator(8, page_size=2)
    got = alloc.alloc(4)
    assert got is not None
    alloc.free(got[:2])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(got[:1])
    with pytest.raises(ValueError):
        alloc.free(slots(8))  # out of range


def test_alloc_extend_fills_the_partial_page_then_new_pages() -> None:
    alloc = SlotAllocator(32, page_size=4)
    first = alloc.alloc_extend(0, -1, 6)  # positions 0..5: page 0 whole, page 1 half
    assert first is not None and first.tolist() == [0, 1, 2, 3, 4, 5]
    more = alloc.alloc_extend(6, int(first[-1]), 7)  # positions 6..12
    assert more is not None and more.tolist() == [6, 7, 8, 9, 10, 11, 12]
    assert alloc.available_size() == 32 - 4 * 4


def test_alloc_extend_positions_within_a_page_share_it() -> None:
    alloc = SlotAllocator(64, page_size=8)
    alloc.alloc(8)  # make page ids differ from positions
    got = alloc.alloc_extend(0, -1, 20)
    assert got is not None
    pages, offsets = got // 8, got % 8
    assert (offsets == np.arange(20) % 8).all()
    assert (pages == pages[np.arange(20) // 8 * 8]).all()


def test_alloc_extend_within_the_partial_page_needs_no_free_page() -> None:
    alloc = SlotAllocator(8, page_size=4)
    got = alloc.alloc_extend(0, -1, 5)
    assert got is not None and alloc.available_size() == 0
    assert alloc.alloc_extend(5, int(got[-1]), 3).tolist() == [5, 6, 7]  # type: ignore[union-attr]
    assert alloc.alloc_extend(8, 7, 1) is None


def test_alloc_extend_rejects_a_last_slot_at_the_wrong_offset() -> None:
    alloc = SlotAllocator(16, page_size=4)
    with pytest.raises(ValueError):
        alloc.alloc_extend(5, 6, 2)


def test_alloc_extend_is_all_or_nothing() -> None:
    alloc = SlotAllocator(8, page_size=4)
    assert alloc.alloc_extend(0, -1, 9) is None
    assert alloc.available_size() == 8


def test_alloc_decode_takes_a_page_only_at_a_boundary() -> None:
    alloc = SlotAllocator(8, page_size=4)
    prompt = alloc.alloc_extend(0, -1, 3)
    assert prompt is not None
    assert alloc.alloc_decode(3, int(prompt[-1])) == 3
    assert alloc.available_size() == 4
    assert alloc.alloc_decode(4, 3) == 4
    assert alloc.available_size() == 0
    assert alloc.alloc_decode(8, 7) is None


def test_alloc_decode_batch_matches_one_by_one_decode() -> None:
    seq_lens = np.array([4, 5, 8, 3, 0])
    last = np.array([103, 12, 27, 42, -1])
    batched, single = SlotAllocator(64, page_size=4), SlotAllocator(64, page_size=4)
    got = batched.alloc_decode_batch(seq_lens, last)
    want = [single.alloc_decode(int(n), int(s)) for n, s in zip(seq_lens, last, strict=True)]
    assert got is not None and got.tolist() == want
    assert batched.free_pages().tolist() == single.free_pages().tolist()


def test_alloc_decode_batch_page1_and_shortage() -> None:
    alloc = SlotAllocator(4)
    got = alloc.alloc_decode_batch(np.array([7, 9, 2]), np.array([0, 0, 0]))
    assert got is not None and got.tolist() == [0, 1, 2]
    assert alloc.alloc_decode_batch(np.array([1, 1]), np.array([0, 0])) is None
    assert alloc.available_size() == 1


def test_same_calls_give_same_ids() -> None:
    def trace() -> list[list[int]]:
        alloc, out, held = SlotAllocator(64, page_size=4), [], []
        for n in (5, 9, 3, 12):
            got = alloc.alloc_extend(0, -1, n)
            assert got is not None
            held.append(got)
            out.append(got.tolist())
        alloc.free(held[1])
        alloc.free(held[0])
        out.append(alloc.alloc(16).tolist())  # type: ignore[union-attr]
        return out

    assert trace() == trace()


def test_ring_wraps_around() -> None:
    alloc = SlotAllocator(4)
    for _ in range(5):
        got = alloc.alloc(3)
        assert got is not None and len(set(got.tolist())) == 3
        alloc.free(got)
    assert sorted(alloc.free_pages().tolist()) == [0, 1, 2, 3]


def test_clear_frees_everything() -> None:
    alloc = SlotAllocator(8, page_size=2)
    alloc.alloc(6)
    alloc.clear()
    assert alloc.available_size() == 8 and alloc.free_pages().tolist() == [0, 1, 2, 3]


# ---- laziness: memory follows use, and the ids handed out are those of the plain ring -------------


def test_never_used_pages_are_not_materialised() -> None:
    alloc = SlotAllocator(10**12, page_size=16)  # would be terabytes if anything were O(capacity)
    got = alloc.alloc(64)
    assert got is not None and got.tolist() == list(range(64))
    alloc.free(got[:16])
    assert alloc.watermark == 4 and alloc.recycled_page_count() == 1
    assert alloc.free_page_count() == 10**12 // 16 - 3
    assert alloc.is_free(slots(0, 15, 16, 10**12 - 1)).tolist() == [True, True, False, True]


def test_views_for_the_integrity_check() -> None:
    alloc = SlotAllocator(64, page_size=4)
    got = alloc.alloc(40)  # pages 0..9
    assert got is not None
    alloc.free(got[20:28])  # pages 5, 6
    alloc.free(got[:4])  # page 0
    assert alloc.recycled_pages(0, 10).tolist() == [5, 6, 0]
    assert alloc.recycled_pages(1, 2).tolist() == [6]
    assert alloc.count_free_pages(0, 16) == 3 + 6 and alloc.count_free_pages(5, 8) == 2
    with pytest.raises(IndexError):
        alloc.is_free(slots(64))


def reference_trace(num_pages: int, page_size: int, ops: list[tuple[str, int]]) -> list[object]:
    """What SGLang's ring does: a deque that starts in id order, pops at the front, appends freed pages
    (unique, sorted) at the back, and is refilled in id order by clear."""
    free: deque[int] = deque(range(num_pages))
    held: list[int] = []
    out: list[object] = []
    for op, arg in ops:
        if op == "alloc":
            if arg > len(free):
                out.append(None)
                continue
            pages = [free.popleft() for _ in range(arg)]
            held.extend(pages)
            out.append([p * page_size + o for p in pages for o in range(page_size)])
        elif op == "free" and held:
            chosen = sorted(set(held[arg % len(held) :: 2]))
            held = [p for p in held if p not in chosen]
            free.extend(chosen)
        elif op == "double_free" and free:
            out.append("refused")
        elif op == "clear":
            free, held = deque(range(num_pages)), []
        out.append((len(free) * page_size, list(free)))
    return out


def lazy_trace(num_pages: int, page_size: int, ops: list[tuple[str, int]]) -> list[object]:
    """The same calls on SlotAllocator, logged in the same shape."""
    alloc = SlotAllocator(num_pages * page_size, page_size)
    held: list[int] = []
    out: list[object] = []
    for op, arg in ops:
        if op == "alloc":
            got = alloc.alloc(arg * page_size)
            if got is None:
                out.append(None)
                continue
            held.extend(int(s) // page_size for s in got[::page_size])
            out.append(got.tolist())
        elif op == "free" and held:
            chosen = held[arg % len(held) :: 2]
            held = [p for p in held if p not in set(chosen)]
            # Any slot of a page frees the whole page; pass them unsorted, the last slot of each.
            alloc.free(np.array([p * page_size + page_size - 1 for p in reversed(chosen)], dtype=np.int64))
        elif op == "double_free" and alloc.free_page_count():
            before = alloc.free_pages().tolist()
            with pytest.raises(ValueError, match="double free"):
                alloc.free(alloc.free_pages()[arg % alloc.free_page_count() :][:1] * page_size)
            assert alloc.free_pages().tolist() == before
            out.append("refused")
        elif op == "clear":
            alloc.clear()
            held = []
        free = alloc.free_pages().tolist()
        marks = alloc.is_free(np.arange(num_pages, dtype=np.int64) * page_size)
        assert sorted(np.flatnonzero(marks).tolist()) == sorted(free)
        out.append((alloc.available_size(), free))
    return out


ops_st = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc", "alloc", "free", "free", "double_free", "clear"]),
        st.integers(0, 9),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(num_pages=st.integers(0, 40), page_size=st.sampled_from([1, 4, 16]), ops=ops_st)
def test_lazy_allocator_hands_out_the_ids_of_the_plain_ring(
    num_pages: int, page_size: int, ops: list[tuple[str, int]]
) -> None:
    assert lazy_trace(num_pages, page_size, ops) == reference_trace(num_pages, page_size, ops)


@settings(max_examples=100, deadline=None)
@given(
    page_size=st.sampled_from([1, 4, 16]),
    steps=st.lists(st.tuples(st.lists(st.integers(0, 40), max_size=12), st.integers(0, 7)), max_size=30),
)
def test_decode_batches_take_pages_in_ring_order(page_size: int, steps: list[tuple[list[int], int]]) -> None:
    """alloc_decode_batch and alloc_extend take new pages from the same front as alloc."""
    alloc, free = SlotAllocator(64 * page_size, page_size), deque(range(64))
    for seq_lens, extend in steps:
        lens = np.array(seq_lens, dtype=np.int64) * page_size  # every sequence starts a page
        got = alloc.alloc_decode_batch(lens, lens - 1)
        want = [free.popleft() * page_size for _ in seq_lens] if len(seq_lens) <= len(free) else None
        assert (got.tolist() if got is not None else None) == want
        if got is not None and len(got):
            alloc.free(got[:1])
            free.append(int(got[0]) // page_size)
        pages = -(-extend // page_size)
        ext = alloc.alloc_extend(0, -1, extend)
        assert (ext is None) == (pages > len(free))
        if ext is not None and pages:
            assert (ext[::page_size] // page_size).tolist() == [free.popleft() for _ in range(pages)]
    assert alloc.free_pages().tolist() == list(free)


def test_lazy_arrays_grow_by_doubling() -> None:
    """Amortised O(1) per page: each array is reallocated O(log pages) times, not once per call."""
    alloc = SlotAllocator(10**7)
    grown = {"queue": 0, "marks": 0}
    queue, marks = alloc._queue, alloc._marks
    for _ in range(2000):
        got = alloc.alloc(256)
        assert got is not None
        alloc.free(got)
        grown["queue"] += alloc._queue is not queue
        grown["marks"] += alloc._marks is not marks
        queue, marks = alloc._queue, alloc._marks
    assert alloc.watermark == 2000 * 256
    assert grown["queue"] <= 12 and grown["marks"] <= 12
