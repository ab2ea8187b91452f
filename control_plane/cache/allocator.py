"""The control plane's KV slot allocator (SCHEDULER.md §7.7, adapted to the split).

The worker owns a KV pool of `capacity` token slots with ids 0..capacity-1; the control plane decides
which ids each sequence uses and sends them in the step plan. With `page_size` P > 1 the ids are grouped
in pages [k·P, (k+1)·P), and positions [j·P, (j+1)·P) of one sequence always live in one page at
matching offsets (slot = page·P + position % P), as in SGLang's paged allocator. The free list is kept
in pages; with P == 1 a page is a slot.

Mutation contract: `alloc*` take pages from the front of the free list, `free` appends pages to its
back, `clear` resets it; everything else only reads. All calls are all-or-nothing: an allocation that
does not fit returns None and changes nothing. The same sequence of calls always yields the same ids.
"""

from __future__ import annotations

import numpy as np

SLOT_DTYPE = np.int64
EMPTY_SLOTS = np.empty(0, dtype=SLOT_DTYPE)
EMPTY_SLOTS.flags.writeable = False


class SlotAllocator:
    """Free-page list of a paged KV pool, as a ring buffer of page ids.

    The ring never overflows: each page is either free (in the ring once) or handed out, and `free`
    rejects a page that is already free, so at most `num_pages` ids are ever queued.
    """

    def __init__(self, capacity: int, page_size: int = 1) -> None:
        if page_size < 1 or capacity < 0 or capacity % page_size:
            raise ValueError(f"capacity {capacity} must be a non-negative multiple of page_size {page_size}")
        self.capacity = capacity
        self.page_size = page_size
        self.num_pages = capacity // page_size
        self._offsets = np.arange(page_size, dtype=SLOT_DTYPE)
        self.clear()

    def clear(self) -> None:
        """Mutates: every page becomes free again, in id order (a flush of the whole pool)."""
        self._ring = np.arange(self.num_pages, dtype=SLOT_DTYPE)
        self._head = 0
        self._count = self.num_pages
        self._page_free = np.ones(self.num_pages, dtype=bool)

    # ---- queries -------------------------------------------------------------------------------

    def available_size(self) -> int:
        """Free token slots: whole free pages × page_size (a partly used page counts as used)."""
        return self._count * self.page_size

    def free_page_count(self) -> int:
        return self._count

    def free_pages(self) -> np.ndarray:
        """A copy of the free list, front (next to hand out) first."""
        return self._take_view(self._count).copy()

    def is_free(self, slots: np.ndarray) -> np.ndarray:
        """Per slot: whether its page is on the free list."""
        return self._page_free[np.asarray(slots, dtype=SLOT_DTYPE) // self.page_size]

    # ---- allocation ----------------------------------------------------------------------------

    def alloc(self, n: int) -> np.ndarray | None:
        """Mutates: `n` fresh slots (whole pages; `n` must be a multiple of page_size), or None."""
        if n % self.page_size:
            raise ValueError(f"alloc({n}) must ask for whole pages of {self.page_size}")
        pages = self._pop_pages(n // self.page_size)
        return None if pages is None else self._page_slots(pages)

    def alloc_extend(self, prefix_len: int, last_slot: int, extend_len: int) -> np.ndarray | None:
        """Mutates: slots for positions [prefix_len, prefix_len + extend_len) of one sequence, or None.

        `last_slot` is the slot of position prefix_len - 1 (-1 when prefix_len == 0). The positions that
        fall in the sequence's current partial page reuse it (last_slot + 1, ...); the rest get new pages.
        Slots of a new last page beyond the extend stay reserved for the sequence's next tokens.
        """
        if extend_len <= 0:
            return EMPTY_SLOTS.copy()
        in_partial = self._partial_page_room(prefix_len, last_slot, extend_len)
        rest = extend_len - in_partial
        pages = self._pop_pages(-(-rest // self.page_size))
        if pages is None:
            return None
        head = np.arange(last_slot + 1, last_slot + 1 + in_partial, dtype=SLOT_DTYPE)
        return np.concatenate((head, self._page_slots(pages)[:rest]))

    def alloc_decode(self, seq_len: int, last_slot: int) -> int | None:
        """Mutates: the slot for the token at position `seq_len` (a new page only at a page boundary)."""
        if seq_len % self.page_size:
            return last_slot + 1
        pages = self._pop_pages(1)
        return None if pages is None else int(pages[0]) * self.page_size

    def alloc_decode_batch(self, seq_lens: np.ndarray, last_slots: np.ndarray) -> np.ndarray | None:
        """Mutates: `alloc_decode` for many sequences at once (all or none), in numpy.

        Sequences whose new position starts a page get new pages in batch order; the others continue
        their page at last_slot + 1.
        """
        if self.page_size == 1:
            return self._pop_pages(len(seq_lens))
        starts_page = np.asarray(seq_lens) % self.page_size == 0
        pages = self._pop_pages(int(np.count_nonzero(starts_page)))
        if pages is None:
            return None
        out = np.asarray(last_slots, dtype=SLOT_DTYPE) + 1
        out[starts_page] = pages * self.page_size
        return out

    # ---- release -------------------------------------------------------------------------------

    def free(self, slots: np.ndarray) -> None:
        """Mutates: returns the pages that `slots` belong to to the back of the free list.

        SGLang's semantics: the unique pages of the given slots are freed (sorted by id), so callers
        must only pass slots of pages they own entirely. Freeing a page that is already free raises
        ValueError (it would let two sequences share a slot) and changes nothing.
        """
        if len(slots) == 0:
            return
        pages = np.unique(np.asarray(slots, dtype=SLOT_DTYPE) // self.page_size)
        if pages[0] < 0 or pages[-1] >= self.num_pages:
            raise ValueError(f"slot ids out of range 0..{self.capacity - 1}")
        if self._page_free[pages].any():
            raise ValueError(f"double free of pages {pages[self._page_free[pages]][:8].tolist()}")
        self._page_free[pages] = True
        self._push_pages(pages)

    # ---- internals -----------------------------------------------------------------------------

    def _partial_page_room(self, prefix_len: int, last_slot: int, extend_len: int) -> int:
        """How many of the extend's positions fit in the sequence's current partial page."""
        offset = prefix_len % self.page_size
        if offset == 0:
            return 0
        if last_slot < 0 or last_slot % self.page_size != offset - 1:
            raise ValueError(f"last_slot {last_slot} does not hold position {prefix_len - 1}")
        return min(self.page_size - offset, extend_len)

    def _page_slots(self, pages: np.ndarray) -> np.ndarray:
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self._offsets).ravel()

    def _take_view(self, k: int) -> np.ndarray:
        """The first k free pages, without removing them (a view when they do not wrap)."""
        end = self._head + k
        if end <= self.num_pages:
            return self._ring[self._head : end]
        return np.concatenate((self._ring[self._head :], self._ring[: end - self.num_pages]))

    def _pop_pages(self, k: int) -> np.ndarray | None:
        if k > self._count:
            return None
        pages = self._take_view(k).copy()
        self._page_free[pages] = False
        self._head = (self._head + k) % self.num_pages if self.num_pages else 0
        self._count -= k
        return pages

    def _push_pages(self, pages: np.ndarray) -> None:
        tail = (self._head + self._count) % self.num_pages
        first = min(len(pages), self.num_pages - tail)
        self._ring[tail : tail + first] = pages[:first]
        self._ring[: len(pages) - first] = pages[first:]
        self._count += len(pages)
