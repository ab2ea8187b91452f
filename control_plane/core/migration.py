"""Live migration: a running request moves to another worker with its KV, and its stream goes on
there without recomputing anything (docs/migration.md).

The control plane owns both workers' slots, so a migration is two plan ops and two recorded
scheduler calls, all on the core's one event loop:

1. Switch (source engine, between two plans): every sample of the call is published up to its last
   token, leaves the source's streams and is finished there by `Scheduler.export`, which caches its
   KV in the source's prefix tree (so its prefix stays there) and has the next plan send the cached
   part to the destination worker's transfer address (KvSend): the worker copies those slots before
   that plan reuses any, and sends in the background. Results in flight for the request are
   dropped (it is finished), so no token is published twice.
2. Copy: the source worker's first result after the bytes arrived (or failed to) carries the
   TransferOutcome. An idle source is asked for it with empty plans every POLL_S.
3. Continue (destination engine): `Scheduler.import_kv` gives the moved KV a place in the
   destination's tree (what it caches already is skipped), the next plan's KvReceive writes it
   before any forward, and the request is admitted as an Orphan (handover.py: prompt plus streamed
   tokens), which matches the whole prefix and extends its last token.

Failures: a copy that fails, or a destination that left meanwhile, and the request continues on the
source (its prefix is cached there, so it too extends one token), or, when the source is leaving,
on another worker by recompute; the destination forgets the transfer. A source lost mid-copy hands
its migrating requests over like its other ones. No request is lost or continued twice: between the
switch and the outcome a request is in exactly one place, this book.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from control_plane import metrics
from control_plane.core.handover import orphan_of
from control_plane.core.inbox import Forget, Immigrant, Orphan
from control_plane.core.publisher import Streams
from control_plane.request import FinishReason
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import TransferOutcome, WorkerLimits

# Why a migrated request left the source's scheduler (never published: its stream goes on).
MIGRATED = FinishReason.abort("continued on another worker (migrated)")
# How often an idle source asks its worker whether a copy has arrived.
POLL_S = 0.002


class Destination(Protocol):
    """An engine a request can migrate to."""

    @property
    def worker(self) -> str: ...

    @property
    def limits(self) -> WorkerLimits: ...

    @property
    def serving(self) -> bool: ...

    def immigrate(self, orphan: Orphan, transfer_id: str, tokens: tuple[int, ...], since: float) -> bool: ...

    def forget_transfer(self, transfer_id: str) -> None: ...

    def adopt(self, orphans: list[Orphan]) -> None: ...


@dataclass(frozen=True, slots=True)
class Export:
    """A sample switched off this worker whose copy has not been reported yet."""

    transfer_id: str
    orphan: Orphan
    # The tokens whose KV is sent (the leading part of the orphan's input).
    tokens: tuple[int, ...]
    destination: Destination
    reason: str
    started: float


class Migrations:
    """One engine's migrations, both ways: the ones leaving it (exports awaiting their outcome) and
    the ones coming to it."""

    def __init__(
        self,
        worker: str,
        limits: WorkerLimits,
        streams: Streams,
        log: structlog.typing.FilteringBoundLogger,
        fallback: Callable[[], Destination | None],
    ) -> None:
        self._worker = worker
        self._limits = limits
        self._streams = streams
        self._log = log
        # Where a request whose copy failed continues: this engine while it serves, else an heir.
        self._fallback = fallback
        self.exports: dict[str, Export] = {}
        # Migrated here and not yet given their first token here: rid -> when the switch was.
        self.stalls: dict[str, float] = {}
        self._last_poll = 0.0
        # Requests that left with their KV, came with it, and failed to leave so (GetServerInfo).
        self.migrated_out = 0
        self.migrated_in = 0
        self.fallbacks = 0

    # --- state ---------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Copies whose outcome is still to come."""
        return bool(self.exports)

    def wants_plan(self, idle: bool) -> bool:
        """Whether the engine should send a plan that does nothing (the scheduler has none): with
        no plan in flight (`idle`), a copy's outcome is due for a look every POLL_S."""
        if not idle or not self.exports:
            return False
        now = time.monotonic()
        if now - self._last_poll < POLL_S:
            return False
        self._last_poll = now
        return True

    def wait_s(self) -> float | None:
        """How long an idle loop may sleep (None: as long as it likes)."""
        return POLL_S if self.exports else None

    # --- leaving this worker -------------------------------------------------------------------

    def can_reach(self, destination: Destination) -> str:
        """Why a request cannot migrate to `destination` ("" when it can)."""
        if destination.worker == self._worker:
            return "it is this worker"
        if not destination.serving:
            return f"worker {destination.worker} takes no requests"
        if not self._limits.transfer_address or not destination.limits.transfer_address:
            return "a worker serves no KV transfer link"
        mine, theirs = self._limits, destination.limits
        if (mine.page_size, mine.dtype, mine.model_fingerprint) != (
            theirs.page_size,
            theirs.dtype,
            theirs.model_fingerprint,
        ):
            return "the workers differ in page size, dtype or model"
        return ""

    def start(self, scheduler: Scheduler, rids: list[str], destination: Destination, reason: str) -> bool:
        """Switch the samples `rids` (one call's live samples: they move together or not at all)
        to `destination`. False, with nothing changed, when one of them is not running here or
        the destination cannot take them."""
        if self.can_reach(destination):
            return False
        reqs = [scheduler.running_request(rid) for rid in rids]
        if any(req is None for req in reqs) or any(rid not in self._streams for rid in rids):
            return False
        self._streams.publish(scheduler.take_updates())  # its tokens so far reach its client first
        now = time.monotonic()
        for req in reqs:
            assert req is not None
            sample = self._streams.get(req.rid)
            assert sample is not None
            orphan = orphan_of(req, sample)
            self._streams.leave(sample)
            transfer_id = f"{self._worker}/{uuid.uuid4().hex}"
            slots = scheduler.export(req.rid, MIGRATED, transfer_id, destination.limits.transfer_address)
            assert slots is not None  # running_request said it runs here
            if not len(slots):  # nothing cached (--disable-radix-cache): it is recomputed there
                destination.adopt([orphan])
                continue
            tokens = tuple(orphan.input_ids[: len(slots)])
            self.exports[transfer_id] = Export(transfer_id, orphan, tokens, destination, reason, now)
        self._log.info("migrating", rids=rids, to=destination.worker, reason=reason)
        return True

    def outcomes(self, outcomes: tuple[TransferOutcome, ...]) -> None:
        """The worker's word on copies: each request continues where its KV now is."""
        now = time.monotonic()
        for outcome in outcomes:
            export = self.exports.pop(outcome.transfer_id, None)
            if export is None:
                self._log.warning("transfer outcome for no migration", transfer_id=outcome.transfer_id)
                continue
            destination = export.destination
            seconds = now - export.started
            if not outcome.error and destination.immigrate(
                export.orphan, export.transfer_id, export.tokens, export.started
            ):
                self.migrated_out += 1
                metrics.MIGRATIONS.labels(self._worker, export.reason, "ok").inc()
                metrics.MIGRATED_TOKENS.labels(self._worker).inc(len(export.tokens))
                metrics.MIGRATION_BYTES.labels(self._worker).inc(outcome.bytes)
                metrics.MIGRATION_COPY_SECONDS.labels(self._worker).observe(seconds)
                self._log.info(
                    "migrated",
                    rid=export.orphan.sample.rid,
                    to=destination.worker,
                    tokens=len(export.tokens),
                    bytes=outcome.bytes,
                    copy_s=round(seconds, 4),
                )
                continue
            why = outcome.error or f"worker {destination.worker} left before the copy arrived"
            destination.forget_transfer(export.transfer_id)
            self._fall_back(export, why)

    def _fall_back(self, export: Export, why: str) -> None:
        self.fallbacks += 1
        metrics.MIGRATIONS.labels(self._worker, export.reason, "fallback").inc()
        heir = self._fallback()
        self._log.warning(
            "migration failed",
            rid=export.orphan.sample.rid,
            to=export.destination.worker,
            error=why,
            continued_on=heir.worker if heir is not None else None,
        )
        if heir is None:
            self._streams.finish(export.orphan.sample, FinishReason.abort(f"migration failed ({why})"))
        else:
            heir.adopt([export.orphan])

    def recovered(self) -> None:
        """The scheduler was replaced after a fault of ours: sends it had not planned yet are gone
        with it, so each request continues by the fallback (its destination forgets the copy; an
        outcome that still comes finds no migration)."""
        exports, self.exports = list(self.exports.values()), {}
        for export in exports:
            export.destination.forget_transfer(export.transfer_id)
            self._fall_back(export, "the control plane's step loop restarted mid-copy")

    def lost(self, heir: Destination | None, error: str) -> None:
        """This worker is lost: its copies will never be reported, so each request continues on
        `heir` by recompute (its destination forgets whatever arrived), or ends if there is none."""
        exports, self.exports = list(self.exports.values()), {}
        for export in exports:
            metrics.MIGRATIONS.labels(self._worker, export.reason, "lost").inc()
            export.destination.forget_transfer(export.transfer_id)
            if heir is None:
                message = f"worker {self._worker} disconnected ({error}) while migrating it"
                self._streams.finish(export.orphan.sample, FinishReason.abort(message))
            else:
                heir.adopt([export.orphan])

    def abort_all(self, message: str) -> None:
        """The engine closes: copies still out end their requests with `message`."""
        exports, self.exports = list(self.exports.values()), {}
        for export in exports:
            export.destination.forget_transfer(export.transfer_id)
            self._streams.finish(export.orphan.sample, FinishReason.abort(message))

    # --- coming to this worker -----------------------------------------------------------------

    def arrive(self, scheduler: Scheduler, item: Immigrant | Forget) -> None:
        """A migrated sample's KV gets a place here, and the next plan receives it (or forgets it,
        when there is no room: the request then recomputes what is missing); a Forget: the next
        plan forgets the transfer."""
        if isinstance(item, Forget):
            scheduler.import_kv(item.transfer_id, ())
            return
        self.migrated_in += 1
        scheduler.import_kv(item.transfer_id, item.tokens)
        self.stalls[item.orphan.sample.rid] = item.since

    def note_tokens(self, scheduler: Scheduler) -> None:
        """After a result: the stall of each migrated request that got its first token here."""
        if not self.stalls:
            return
        now = time.monotonic()
        for rid, since in list(self.stalls.items()):
            req = scheduler.requests.get(rid)
            if req is None or req.num_outputs:
                del self.stalls[rid]
                metrics.MIGRATION_STALL_SECONDS.labels(self._worker).observe(now - since)
