"""The books of what the worker holds, and the changes to them that the next plan carries.

A sequence lives on the worker under a handle from its first extend until it is released. The books
are the live sequences (offloaded ones aside) with the sum of their slot tables (= their
kv_allocated_len), which the worker reports after every step (`books()`), and the host backup pool
(docs/scheduler.md#host-backup-pool): a retracted request's KV waits there, under its handle, until
re-admission restores it into fresh slots. Releases, remaps, offloads and restores queue here until
the next plan takes them, and so do the KV moves of a migration (docs/migration.md): sends of a
request's slots to another worker, and receives of another worker's KV into slots here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from control_plane.request import Request
from protos.worker import KvReceive, KvSend, KvTransfer, SlotRemap


@dataclass(frozen=True, slots=True)
class PlanDeltas:
    """What a plan carries besides its work: applied by the worker before the extends and decodes."""

    releases: np.ndarray
    remaps: tuple[SlotRemap, ...]
    offloads: tuple[KvTransfer, ...]
    restores: tuple[KvTransfer, ...]
    sends: tuple[KvSend, ...] = ()
    receives: tuple[KvReceive, ...] = ()


def frozen_empty(dtype: type) -> np.ndarray:
    empty: np.ndarray = np.zeros(0, dtype=dtype)
    empty.flags.writeable = False
    return empty


# What a plan carries when the books queued nothing: one shared value (frozen, its array read-only).
NO_DELTAS = PlanDeltas(frozen_empty(np.int64), (), (), ())


class SequenceBooks:
    """Handles, the worker's slot tables and host pool as the scheduler accounts them."""

    def __init__(self, host_capacity: int) -> None:
        # Sequences the worker holds after the most recent plan (offloaded ones aside), and the sum
        # of their slot tables: the books `books()` reports.
        self.by_handle: dict[int, Request] = {}
        self.seq_slots = 0
        self._next_handle = 1
        self.host_capacity = host_capacity
        self.host_used = 0
        self.offloaded: dict[int, Request] = {}
        self._releases: list[int] = []
        self._remaps: list[SlotRemap] = []
        self._offloads: list[KvTransfer] = []
        self._restores: list[KvTransfer] = []
        self._sends: list[KvSend] = []
        self._receives: list[KvReceive] = []

    # --- sequences -------------------------------------------------------------------------------

    def holds(self, req: Request) -> bool:
        """The worker holds this request's sequence on the device."""
        return req.handle in self.by_handle

    def introduce(self, req: Request) -> bool:
        """A handle for a request that has none (it gets a NewSeq in the plan); returns whether it
        was introduced now."""
        if req.handle >= 0:
            return False
        req.handle = self._next_handle
        self._next_handle += 1
        self.by_handle[req.handle] = req
        return True

    def grow(self, slots: int) -> None:
        """The worker's slot tables grow by `slots` (an extend's new positions, a decode's slot each)."""
        self.seq_slots += slots

    def release(self, req: Request) -> None:
        """The worker forgets this sequence in the next plan (and drops any host backup of it)."""
        self._releases.append(req.handle)
        self.forget(req)
        if self.offloaded.pop(req.handle, None) is not None:
            self.host_used -= req.host_backup_len
            req.host_backup_len = 0
        req.handle = -1

    def forget(self, req: Request) -> None:
        """Out of the books: the worker will no longer hold this sequence's slot table on the device."""
        if self.by_handle.pop(req.handle, None) is not None:
            self.seq_slots -= req.kv_allocated_len

    def remap(self, remap: SlotRemap | None) -> None:
        if remap is not None:
            self._remaps.append(remap)

    # --- the host backup pool (docs/scheduler.md#host-backup-pool) ------------------------------------

    def back_up(self, req: Request, row: np.ndarray) -> bool | None:
        """Offload the request's committed KV (its slots in `row`) to the host pool, where the
        worker keeps it under the handle: None when there is no host pool, False when it has no
        room. Only committed positions: a decode in flight for it wrote one more, whose token is
        discarded; the re-prefill after the restore recomputes it."""
        if not self.host_capacity:
            return None
        n = req.kv_committed_len
        if self.host_used + n > self.host_capacity:
            return False
        self._offloads.append(KvTransfer(req.handle, row[:n].copy()))
        self.host_used += n
        req.host_backup_len = n
        self.forget(req)
        self.offloaded[req.handle] = req
        return True

    def restore(self, req: Request, row: np.ndarray) -> int:
        """Copy the host backup into the first slots of the request's fresh row; returns how many
        positions it covers (the extend computes only the rest)."""
        n = req.host_backup_len
        self._restores.append(KvTransfer(req.handle, row[:n].copy()))
        del self.offloaded[req.handle]
        self.by_handle[req.handle] = req
        self.host_used -= n
        req.host_backup_len = 0
        return n

    # --- KV that moves between workers (docs/migration.md) ---------------------------------------

    def send(self, send: KvSend) -> None:
        """The next plan sends these slots' KV to another worker (read before it reuses them)."""
        self._sends.append(send)

    def receive(self, receive: KvReceive) -> None:
        """The next plan writes a transfer from another worker into slots here (or forgets it)."""
        self._receives.append(receive)

    # --- what the next plan carries ----------------------------------------------------------------

    @property
    def has_deltas(self) -> bool:
        """Something for the worker even without work: a plan is due."""
        return bool(self._releases or self._remaps or self._offloads or self._sends or self._receives)

    def take_deltas(self) -> PlanDeltas:
        if not (self.has_deltas or self._restores):
            return NO_DELTAS  # most plans (a decode step's) carry none
        releases = np.asarray(self._releases, dtype=np.int64)
        # A remap or an offload queued for a request released since (retracted, preempted, aborted,
        # refused re-entry by a full queue) is moot: the worker drops the sequence first.
        released = set(self._releases)
        deltas = PlanDeltas(
            releases=releases,
            remaps=tuple(r for r in self._remaps if r.handle not in released),
            offloads=tuple(t for t in self._offloads if t.handle not in released),
            restores=tuple(self._restores),
            sends=tuple(self._sends),
            receives=tuple(self._receives),
        )
        self._releases, self._remaps, self._offloads, self._restores = [], [], [], []
        self._sends, self._receives = [], []
        return deltas

    # --- figures -------------------------------------------------------------------------------------

    def private_slots(self, page_size: int) -> int:
        """Slots held by live requests and not owned by the tree (whole pages), decodes in flight
        included. O(live requests): for invariant checks."""
        return sum(
            math.ceil(r.kv_allocated_len / page_size) * page_size - r.cache_protected_len
            for r in self.by_handle.values()
        )
