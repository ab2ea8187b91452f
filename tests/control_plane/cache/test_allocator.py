"""SlotAllocator: paged allocation contract (SCHEDULER.md §7.7) and determinism."""

from __future__ import annotations

import numpy as np
import pytest

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
