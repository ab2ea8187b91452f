"""The control plane's KV slot allocator (docs/scheduler.md#allocation, adapted to the split).

The worker owns a KV pool of `capacity` token slots with ids 0..capacity-1; the control plane decides
which ids each sequence uses and sends them in the step plan. With `page_size` P > 1 the ids are grouped
in pages [k·P, (k+1)·P), and positions [j·P, (j+1)·P) of one sequence always live in one page at
matching offsets (slot = page·P + position % P), as in SGLang's paged allocator. The free list is kept
in pages; with P == 1 a page is a slot.

Mutation contract: `alloc*` take pages from the front of the free list, `free` appends pages to its
back, `clear` resets it; everything else only reads. All calls are all-or-nothing: an allocation that
does not fit returns None and changes nothing. The same sequence of calls always yields the same ids.

Memory grows with the pages handed out since the last `clear`, never with capacity: a worker may claim
any pool size at hello without the control plane allocating for it up front.
"""

from __future__ import annotations

import numpy as np

SLOT_DTYPE = np.int64
EMPTY_SLOTS = np.empty(0, dtype=SLOT_DTYPE)
EMPTY_SLOTS.flags.writeable = False

# Smallest size of the lazily grown arrays, so that early small allocations do not regrow them each time.
_MIN_GROWTH = 1024


class SlotAllocator:
    """Free-page list of a paged KV pool: SGLang's ring of page ids, kept lazily.

    The free list behaves exactly like a ring that starts as every page id in order, hands pages out
    from its front and takes freed pages back at its back. The pages never handed out since the last
    `clear` always sit at the front, in id order, so they are kept as the range [watermark, num_pages)
    instead of being listed; the pages freed since then follow them, in a FIFO queue (`_queue`, a ring
    buffer). `_marks[p]` says whether page p < watermark is free; pages ≥ watermark are free by
    definition and `_marks[watermark:]` is all False. Both arrays grow by doubling as the watermark
    rises, so memory is O(pages ever handed out), not O(capacity).
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
        self._watermark = 0
        self._marks = np.zeros(0, dtype=bool)
        self._queue = np.empty(0, dtype=SLOT_DTYPE)
        self._queue_head = 0
        self._queue_len = 0

    # ---- queries -------------------------------------------------------------------------------

    def available_size(self) -> int:
        """Free token slots: whole free pages × page_size (a partly used page counts as used)."""
        return self.free_page_count() * self.page_size

    def free_page_count(self) -> int:
        return self.num_pages - self._watermark + self._queue_len

    def free_pages(self) -> np.ndarray:
        """A copy of the free list, front (next to hand out) first.

        O(capacity) time and memory: it lists every never-used page. For tests and debugging only;
        nothing on the hot path or in the idle check may call it.
        """
        fresh = np.arange(self._watermark, self.num_pages, dtype=SLOT_DTYPE)
        return np.concatenate((fresh, self.recycled_pages(0, self._queue_len)))

    def is_free(self, slots: np.ndarray) -> np.ndarray:
        """Per slot: whether its page is on the free list. Raises IndexError for ids outside the pool."""
        pages = np.asarray(slots, dtype=SLOT_DTYPE) // self.page_size
        if len(pages) and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise IndexError(f"slot ids out of range 0..{self.capacity - 1}")
        return self._pages_free(pages)

    # ---- read-only views for the integrity check (O(what they return)) -------------------------

    @property
    def watermark(self) -> int:
        """Pages [watermark, num_pages) were never handed out since the last `clear` (all free)."""
        return self._watermark

    def recycled_page_count(self) -> int:
        """Free pages below the watermark: the length of the queue of freed pages."""
        return self._queue_len

    def recycled_pages(self, start: int, stop: int) -> np.ndarray:
        """A copy of entries [start, stop) of the queue of freed pages, front (next to reuse) first."""
        start, stop = max(0, start), min(stop, self._queue_len)
        if start >= stop:
            return EMPTY_SLOTS.copy()
        size = len(self._queue)
        first = (self._queue_head + start) % size
        end = first + stop - start
        if end <= size:
            return self._queue[first:end].copy()
        return np.concatenate((self._queue[first:], self._queue[: end - size]))

    def count_free_pages(self, start: int, stop: int) -> int:
        """How many pages with ids in [start, stop) are free, by the marks (O(stop - start))."""
        start, stop = max(0, start), min(stop, self.num_pages)
        if start >= stop:
            return 0
        below = min(stop, self._watermark)
        marked = int(np.count_nonzero(self._marks[start:below])) if start < below else 0
        return marked + max(0, stop - max(start, self._watermark))

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
        # `pages` is sorted, so one comparison covers the never-used pages (free by definition).
        if pages[-1] >= self._watermark or self._marks[pages].any():
            already = pages[self._pages_free(pages)]
            raise ValueError(f"double free of pages {already[:8].tolist()}")
        self._marks[pages] = True
        self._enqueue(pages)

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

    def _pages_free(self, pages: np.ndarray) -> np.ndarray:
        """Per page id in 0..num_pages-1: whether it is free (a fresh bool array)."""
        free = pages >= self._watermark
        below = ~free
        free[below] = self._marks[pages[below]]
        return free

    def _pop_pages(self, k: int) -> np.ndarray | None:
        """Mutates: the first k pages of the free list (a fresh array), or None when fewer are free.

        The never-used pages come first, in id order; then the freed ones, oldest free first.
        """
        if k > self.free_page_count():
            return None
        fresh = min(k, self.num_pages - self._watermark)
        start = self._watermark
        if fresh:
            self._raise_watermark(start + fresh)
        if fresh == k:
            return np.arange(start, start + fresh, dtype=SLOT_DTYPE)
        reused = self._dequeue(k - fresh)
        self._marks[reused] = False
        if fresh == 0:
            return reused
        return np.concatenate((np.arange(start, start + fresh, dtype=SLOT_DTYPE), reused))

    def _raise_watermark(self, watermark: int) -> None:
        """Mutates: pages below `watermark` are now tracked by the marks (as not free: handed out)."""
        if watermark > len(self._marks):
            size = min(self.num_pages, max(watermark, 2 * len(self._marks), _MIN_GROWTH))
            marks = np.zeros(size, dtype=bool)
            marks[: len(self._marks)] = self._marks
            self._marks = marks
        self._watermark = watermark

    def _dequeue(self, k: int) -> np.ndarray:
        """Mutates: removes and returns the k oldest freed pages (k ≤ the queue's length)."""
        pages = self.recycled_pages(0, k)
        self._queue_head = (self._queue_head + k) % len(self._queue) if len(self._queue) else 0
        self._queue_len -= k
        return pages

    def _enqueue(self, pages: np.ndarray) -> None:
        """Mutates: appends `pages` to the back of the queue of freed pages, growing it if needed."""
        needed = self._queue_len + len(pages)
        if needed > len(self._queue):
            self._grow_queue(needed)
        size = len(self._queue)
        tail = (self._queue_head + self._queue_len) % size
        first = min(len(pages), size - tail)
        self._queue[tail : tail + first] = pages[:first]
        self._queue[: len(pages) - first] = pages[first:]
        self._queue_len = needed

    def _grow_queue(self, needed: int) -> None:
        """Mutates: a ring buffer twice as large or more (≥ needed, which is ≤ the watermark since the
        queued pages are distinct pages below it), with the queue moved to its start."""
        size = min(max(needed, 2 * len(self._queue), _MIN_GROWTH), self.num_pages)
        queue = np.empty(size, dtype=SLOT_DTYPE)
        queue[: self._queue_len] = self.recycled_pages(0, self._queue_len)
        self._queue = queue
        self._queue_head = 0
